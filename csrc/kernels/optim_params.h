// Parameters of the fused optimizer steps (gradacc::adamw_step_, sgd_step_).
//
// Filled by csrc/binding_optim.cpp after every tensor check; the CPU kernels
// (cpu/optim_cpu.cpp) and the CUDA launcher (cuda/optim_kernels.cu) trust
// them completely. Torch-free.
#pragma once

#include <cstdint>
#include <vector>

#include "optim_math.cuh"
#include "params.h"

namespace gradacc {

enum class OptimKind : int8_t { kAdamW = 0, kSgd = 1 };

// How a 16-bit param stores its new value (fp32/fp64 params: always kNearest).
enum class ParamMode : int8_t {
  kNearest = 0,     // round to nearest even
  kMaster = 1,      // update the fp32 master copy, store its rounding in the param
  kStochastic = 2,  // stochastic rounding, reproducible from (seed, step, position)
};

struct OptimParams {
  OptimKind kind = OptimKind::kAdamW;
  std::vector<Span> params;  // fp64, fp32, fp16 or bf16
  std::vector<Span> grads;   // each the param's dtype or fp32
  // AdamW: exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad only). SGD:
  // momentum_buffer (momentum only). Unused lists are empty. State is fp32,
  // fp64 for fp64 params.
  std::vector<Span> state[3];
  std::vector<Span> masters;  // fp32 copies of 16-bit params (kMaster), else empty
  // Step counts (one-element fp32): one per param or one shared by all;
  // incremented after the update unless *found_inf != 0. SGD without
  // momentum may pass none.
  std::vector<float*> steps;

  OptimScalars scalars;
  const float* lr_ptr = nullptr;         // optional: multiplies scalars.lr
  const float* grad_mult_ptr = nullptr;  // optional: multiplies every grad
  const float* found_inf = nullptr;      // optional: nonzero skips the whole step
  ParamMode mode = ParamMode::kNearest;
  int64_t seed = 0;  // kStochastic
};

}  // namespace gradacc
