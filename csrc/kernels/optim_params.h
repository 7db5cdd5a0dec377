// Parameters of the fused optimizer steps (every optimizer of optim_traits.cuh).
//
// Filled by csrc/binding_optim.cpp after every tensor check; the CPU kernels
// (cpu/optim_cpu.cpp) and the CUDA launcher (cuda/optim_kernels.cu) trust
// them completely. Torch-free.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "optim_traits.cuh"
#include "params.h"

namespace gradacc {

// How a 16-bit param stores its new value (fp32/fp64 params: always kNearest).
enum class ParamMode : int8_t {
  kNearest = 0,     // round to nearest even
  kMaster = 1,      // update the fp32 master copy, store its rounding in the param
  kStochastic = 2,  // stochastic rounding, reproducible from (seed, step, position)
};

// How the state lists store their values (LOWBIT_SPEC.md), one kind per call, inferred from the state
// tensors' dtypes. The kernels take it as a compile-time parameter (dispatch_storage).
enum class StateStorage : int8_t {
  kFloat = 0,     // float32 (float64 for fp64 params): loaded and stored exactly
  kBFloat16 = 1,  // bfloat16, stored with stochastic rounding (quant_math.cuh's state_random_bits)
  kInt8 = 2,      // uint8 codes, one float32 absmax per kQuantBlock elements in `scales` (quant_math.cuh)
};

struct OptimParams {
  int kind = 0;               // the optimizer's index in Optimizers (optim_traits.cuh)
  std::vector<Span> params;  // fp64, fp32, fp16 or bf16
  std::vector<Span> grads;   // each the param's dtype or fp32
  // The optimizer's state lists in its slot order (T::kState); a list not
  // given is empty. Its elements are `storage`'s: fp32 (fp64 for fp64 params),
  // bf16, or uint8 codes (int8).
  std::vector<Span> state[kMaxStateSlots];
  StateStorage storage = StateStorage::kFloat;
  // int8 only (else empty): per given state list, one float32 tensor per param of
  // ceil(numel / kQuantBlock) block absmaxes, read and written.
  std::vector<Span> scales[kMaxStateSlots];
  std::vector<Span> masters;  // fp32 copies of 16-bit params (kMaster), else empty
  // Step counts (one-element fp32): one per param or one shared by all;
  // incremented after the update unless *found_inf != 0. None where the
  // optimizer does not require them (T::steps_required).
  std::vector<float*> steps;

  OptimScalars scalars;
  const float* lr_ptr = nullptr;         // optional: multiplies scalars.lr
  const float* grad_mult_ptr = nullptr;  // optional: multiplies every grad
  const float* found_inf = nullptr;      // optional: nonzero skips the whole step
  ParamMode mode = ParamMode::kNearest;
  int64_t seed = 0;  // kStochastic
};

// The step's compile-time variant of optimizer T (T::flags).
template <typename T>
int optim_flags(const OptimParams& p) {
  bool has[kMaxStateSlots];
  for (int s = 0; s < kMaxStateSlots; ++s) has[s] = !p.state[s].empty();
  return T::flags(p.scalars.option, has);
}

template <StateStorage S>
using StorageTag = std::integral_constant<StateStorage, S>;

// Calls f(StorageTag<S>{}) with the call's storage as a compile-time constant.
template <typename F>
GRADACC_HD void dispatch_storage(StateStorage storage, F&& f) {
  switch (storage) {
    case StateStorage::kBFloat16: f(StorageTag<StateStorage::kBFloat16>{}); break;
    case StateStorage::kInt8: f(StorageTag<StateStorage::kInt8>{}); break;
    default: f(StorageTag<StateStorage::kFloat>{}); break;
  }
}

}  // namespace gradacc
