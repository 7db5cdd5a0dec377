// Host side of the fused optimizer steps: the update kernel over every
// chunk, then the step counts' increment. Torch-free.
#include <algorithm>
#include <utility>
#include <vector>

#include "../kernels/optim_step.cuh"
#include "batches.cuh"
#include "optim_launch.h"

namespace gradacc::cuda {
namespace {

// Every instantiation has the same type (spelled this way, it also holds in the
// host emulation of tests/emulation, which rewrites kernel signatures).
using Kernel = decltype(&optim_kernel<AdamW, 0>);

template <typename T, int... F>
Kernel kernel_of(int flags, std::integer_sequence<int, F...>) {
  static constexpr Kernel kTable[] = {optim_kernel<T, F>...};
  return kTable[flags];
}

// The instantiation for the step's optimizer and compile-time variant.
Kernel pick_kernel(const OptimParams& p) {
  Kernel kernel = nullptr;
  dispatch_optim(p.kind, [&](auto traits) {
    using T = decltype(traits);
    kernel = kernel_of<T>(optim_flags<T>(p), std::make_integer_sequence<int, 1 << T::kFlagBits>{});
  });
  return kernel;
}

// A list of `n` null spans standing in for an unused list.
std::vector<Span> or_nulls(const std::vector<Span>& list, size_t n) {
  return list.empty() ? std::vector<Span>(n, Span{nullptr, 0, DType::kFloat32}) : list;
}

}  // namespace

cudaError_t launch_optim_step(const OptimParams& p, cudaStream_t stream) {
  const size_t n = p.params.size();
  static_assert(kMaxStateSlots == 3, "the lists below name every state slot");
  std::vector<Span> state[kMaxStateSlots];
  for (int s = 0; s < kMaxStateSlots; ++s) state[s] = or_nulls(p.state[s], n);
  const std::vector<Span> masters = or_nulls(p.masters, n);
  std::vector<Span> steps(n, Span{nullptr, 0, DType::kFloat32});
  for (size_t t = 0; t < n && !p.steps.empty(); ++t) steps[t].data = p.steps[p.steps.size() == 1 ? 0 : t];

  const OptimArgs args{p.scalars, p.lr_ptr, p.grad_mult_ptr, p.found_inf, p.seed, p.mode};
  const Kernel kernel = pick_kernel(p);
  cudaError_t err = for_each_batch<kOptimDepth>(
      {&p.params, &p.grads, &state[0], &state[1], &state[2], &masters, &steps},
      [&](const ListMeta<kOptimDepth>& meta, unsigned blocks) { kernel<<<blocks, kBlockThreads, 0, stream>>>(meta, args); });
  if (err != cudaSuccess) return err;

  StepList list;
  list.found_inf = p.found_inf;
  for (size_t first = 0; first < p.steps.size(); first += kStepBatch) {
    list.count = int(std::min(p.steps.size() - first, size_t(kStepBatch)));
    std::copy_n(p.steps.begin() + first, list.count, list.ptr);
    const unsigned blocks = unsigned((list.count + kBlockThreads - 1) / kBlockThreads);
    step_increment_kernel<<<blocks, kBlockThreads, 0, stream>>>(list);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace gradacc::cuda
