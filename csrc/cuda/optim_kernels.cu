// Host side of the fused optimizer steps: the update kernel over every
// chunk, then the step counts' increment. Torch-free.
#include <algorithm>
#include <vector>

#include "../kernels/optim_step.cuh"
#include "batches.cuh"
#include "optim_launch.h"

namespace gradacc::cuda {
namespace {

// Every instantiation has the same type (spelled this way, it also holds in the
// host emulation of tests/emulation, which rewrites kernel signatures).
using Kernel = decltype(&optim_kernel<OptimKind::kAdamW, false, false, false>);

template <OptimKind kKind, bool kA, bool kB, bool kC>
Kernel kernel_of() {
  return optim_kernel<kKind, kA, kB, kC>;
}

// The instantiation for the step's compile-time flags.
Kernel pick_kernel(const OptimParams& p) {
  if (p.kind == OptimKind::kAdamW) {
    return p.state[2].empty() ? kernel_of<OptimKind::kAdamW, false, false, false>()
                              : kernel_of<OptimKind::kAdamW, true, false, false>();
  }
  const bool momentum = !p.state[0].empty(), nesterov = p.scalars.nesterov, decay = p.scalars.weight_decay != 0.0;
  const int flags = (momentum ? 4 : 0) | (nesterov ? 2 : 0) | (decay ? 1 : 0);
  constexpr OptimKind S = OptimKind::kSgd;
  switch (flags) {
    case 0: return kernel_of<S, false, false, false>();
    case 1: return kernel_of<S, false, false, true>();
    case 2: return kernel_of<S, false, true, false>();
    case 3: return kernel_of<S, false, true, true>();
    case 4: return kernel_of<S, true, false, false>();
    case 5: return kernel_of<S, true, false, true>();
    case 6: return kernel_of<S, true, true, false>();
    default: return kernel_of<S, true, true, true>();
  }
}

// A list of `n` null spans standing in for an unused list.
std::vector<Span> or_nulls(const std::vector<Span>& list, size_t n) {
  return list.empty() ? std::vector<Span>(n, Span{nullptr, 0, DType::kFloat32}) : list;
}

}  // namespace

cudaError_t launch_optim_step(const OptimParams& p, cudaStream_t stream) {
  const size_t n = p.params.size();
  const std::vector<Span> s0 = or_nulls(p.state[0], n), s1 = or_nulls(p.state[1], n), s2 = or_nulls(p.state[2], n);
  const std::vector<Span> masters = or_nulls(p.masters, n);
  std::vector<Span> steps(n, Span{nullptr, 0, DType::kFloat32});
  for (size_t t = 0; t < n && !p.steps.empty(); ++t) steps[t].data = p.steps[p.steps.size() == 1 ? 0 : t];

  const OptimArgs args{p.scalars, p.lr_ptr, p.grad_mult_ptr, p.found_inf, p.seed, p.mode};
  const Kernel kernel = pick_kernel(p);
  cudaError_t err = for_each_batch<kOptimDepth>(
      {&p.params, &p.grads, &s0, &s1, &s2, &masters, &steps},
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
