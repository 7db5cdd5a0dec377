// C entry points of the host-emulated optimizer-step launcher
// (csrc/cuda/optim_kernels.cu built with shim/cuda_runtime_api.h), for
// tests/test_emulation_optim.py (ctypes). The params are filled as
// csrc/binding_optim.cpp fills them after its checks.
#include "../kernels/optim_step.cuh"  // resolved through -I csrc/cuda
#include "emu_common.h"
#include "optim_launch.h"

using emu_entry::EmuSpan;
using gradacc::cuda::ListMeta;

extern "C" {

int emu_optim_capacity() { return ListMeta<gradacc::cuda::kOptimDepth>::kCapacity; }

int emu_step_batch() { return gradacc::cuda::kStepBatch; }

// lists: params, grads, state 0..2, masters (an unused list has length 0);
// scalars: lr, weight_decay, beta1, beta2, eps, momentum, dampening.
int emu_optim_step(int kind, const EmuSpan* const* lists, const int64_t* lengths, float* const* steps,
                   int64_t num_steps, const double* scalars, int maximize, int nesterov, const float* lr_ptr,
                   const float* grad_mult_ptr, const float* found_inf, int mode, int64_t seed, char* err,
                   size_t err_len) {
  gradacc::OptimParams p;
  p.kind = gradacc::OptimKind(kind);
  p.params = emu_entry::spans(lists[0], lengths[0]);
  p.grads = emu_entry::spans(lists[1], lengths[1]);
  for (int s = 0; s < 3; ++s) p.state[s] = emu_entry::spans(lists[2 + s], lengths[2 + s]);
  p.masters = emu_entry::spans(lists[5], lengths[5]);
  p.steps.assign(steps, steps + num_steps);
  p.scalars.lr = scalars[0];
  p.scalars.weight_decay = scalars[1];
  p.scalars.beta1 = scalars[2];
  p.scalars.beta2 = scalars[3];
  p.scalars.eps = scalars[4];
  p.scalars.momentum = scalars[5];
  p.scalars.dampening = scalars[6];
  p.scalars.maximize = maximize != 0;
  p.scalars.nesterov = nesterov != 0;
  p.lr_ptr = lr_ptr;
  p.grad_mult_ptr = grad_mult_ptr;
  p.found_inf = found_inf;
  p.mode = gradacc::ParamMode(mode);
  p.seed = seed;
  // As register_optim_cuda.cpp: no params, no launch (and no step counted).
  if (p.params.empty()) return 0;
  return emu_entry::finish(gradacc::cuda::launch_optim_step(p, nullptr), err, err_len);
}

}  // extern "C"
