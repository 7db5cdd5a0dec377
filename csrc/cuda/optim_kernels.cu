// Host side of the fused optimizer steps: the update kernel over every
// chunk, then the step counts' increment. Torch-free.
#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "../kernels/optim_step.cuh"
#include "batches.cuh"
#include "optim_launch.h"

namespace gradacc::cuda {
namespace {

// The instantiations of one storage have one type (spelled this way, it also holds in the host
// emulation of tests/emulation, which rewrites kernel signatures).
template <StateStorage S>
using Kernel = decltype(&optim_kernel<AdamW, 0, S>);

// Whether variant kFlags of T reads and writes any state slot. One that does not (SGD without
// momentum) runs the fp32-state kernel whatever the storage: the storage changes nothing there.
template <typename T>
constexpr bool uses_any_state(int flags) {
  bool any = false;
  for (int s = 0; s < T::kSlots; ++s) any = any || T::uses(s, flags);
  return any;
}

// Whether (T, kFlags) has a kernel for storage S: fp32 always, bf16 and int8 where the variant uses a
// state, int8 not where a slot it uses refuses int8 (AdamW's amsgrad: the binding refuses the call).
template <typename T, int kFlags, StateStorage S>
constexpr bool instantiated() {
  if constexpr (S == StateStorage::kFloat) {
    return true;
  } else {
    bool ok = uses_any_state<T>(kFlags);
    for (int s = 0; s < T::kSlots && S == StateStorage::kInt8; ++s) ok = ok && !(T::uses(s, kFlags) && T::kNoInt8[s]);
    return ok;
  }
}

template <typename T, StateStorage S, int F>
constexpr Kernel<S> kernel_or_null() {
  if constexpr (instantiated<T, F, S>()) return optim_kernel<T, F, S>;
  else return nullptr;
}

template <typename T, StateStorage S, int... F>
Kernel<S> kernel_of(int flags, std::integer_sequence<int, F...>) {
  static constexpr Kernel<S> kTable[] = {kernel_or_null<T, S, F>()...};
  return kTable[flags];
}

// The instantiation for the step's optimizer, compile-time variant and storage S; null where the
// variant has none for S.
template <StateStorage S>
Kernel<S> pick_kernel(const OptimParams& p) {
  Kernel<S> kernel = nullptr;
  dispatch_optim(p.kind, [&](auto traits) {
    using T = decltype(traits);
    kernel = kernel_of<T, S>(optim_flags<T>(p), std::make_integer_sequence<int, 1 << T::kFlagBits>{});
  });
  return kernel;
}

// Whether the step's variant reads and writes any state slot.
bool uses_state(const OptimParams& p) {
  bool any = false;
  dispatch_optim(p.kind, [&](auto traits) { any = uses_any_state<decltype(traits)>(optim_flags<decltype(traits)>(p)); });
  return any;
}

// A list of `n` null spans standing in for an unused list.
std::vector<Span> or_nulls(const std::vector<Span>& list, size_t n) {
  return list.empty() ? std::vector<Span>(n, Span{nullptr, 0, DType::kFloat32}) : list;
}

// The update kernel over every chunk, with the state lists stored as S (int8: with their scales).
template <StateStorage S>
cudaError_t launch_update(const OptimParams& p, cudaStream_t stream) {
  const size_t n = p.params.size();
  static_assert(kMaxStateSlots == 3, "the lists below name every state slot");
  std::vector<Span> state[kMaxStateSlots], scales[kMaxStateSlots];
  for (int s = 0; s < kMaxStateSlots; ++s) state[s] = or_nulls(p.state[s], n), scales[s] = or_nulls(p.scales[s], n);
  const std::vector<Span> masters = or_nulls(p.masters, n);
  std::vector<Span> steps(n, Span{nullptr, 0, DType::kFloat32});
  for (size_t t = 0; t < n && !p.steps.empty(); ++t) steps[t].data = p.steps[p.steps.size() == 1 ? 0 : t];

  const OptimArgs args{p.scalars, p.lr_ptr, p.grad_mult_ptr, p.found_inf, p.seed, p.mode};
  Kernel<S> kernel = pick_kernel<S>(p);
  if constexpr (S != StateStorage::kFloat) {
    if (kernel == nullptr && !uses_state(p)) return launch_update<StateStorage::kFloat>(p, stream);
  }
  if (kernel == nullptr) return cudaErrorInvalidValue;  // int8 where a slot refuses it: the binding refuses first
  constexpr int D = optim_depth(S);
  std::array<const std::vector<Span>*, D> lists;
  const std::vector<Span>* all[] = {&p.params, &p.grads, &state[0], &state[1], &state[2], &masters, &steps,
                                    &scales[0], &scales[1], &scales[2]};
  std::copy_n(all, D, lists.begin());
  return for_each_batch<D>(lists, [&](const OptimMeta<S>& meta, unsigned blocks) {
    kernel<<<blocks, kBlockThreads, 0, stream>>>(meta, args);
  });
}

}  // namespace

cudaError_t launch_optim_step(const OptimParams& p, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  dispatch_storage(p.storage, [&](auto storage) { err = launch_update<decltype(storage)::value>(p, stream); });
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
