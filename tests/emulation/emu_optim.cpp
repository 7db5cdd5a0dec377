// C entry points of the host-emulated optimizer-step launcher
// (csrc/cuda/optim_kernels.cu built with shim/cuda_runtime_api.h), for
// tests/test_emulation_optim.py (ctypes). The params are filled as
// csrc/binding_optim.cpp fills them after its checks, for any optimizer of
// csrc/kernels/optim_traits.cuh, named by its op.
#include "../kernels/optim_step.cuh"  // resolved through -I csrc/cuda
#include "emu_common.h"
#include "optim_launch.h"

using emu_entry::EmuSpan;
using gradacc::cuda::ListMeta;

extern "C" {

int emu_optim_capacity() { return ListMeta<gradacc::cuda::kOptimDepth>::kCapacity; }

int emu_quant_optim_capacity() { return ListMeta<gradacc::cuda::kQuantOptimDepth>::kCapacity; }

int emu_step_batch() { return gradacc::cuda::kStepBatch; }

// lists: params, grads, the state slots (kMaxStateSlots), masters, the state
// slots' scales (kMaxStateSlots; an unused list has length 0); storage:
// gradacc::StateStorage; options: the optimizer's kOptions in order.
int emu_optim_step(const char* name, const EmuSpan* const* lists, const int64_t* lengths, float* const* steps,
                   int64_t num_steps, double lr, const double* options, int num_options, int maximize,
                   const float* lr_ptr, const float* grad_mult_ptr, const float* found_inf, int mode, int64_t seed,
                   int storage, char* err, size_t err_len) {
  gradacc::OptimParams p;
  p.kind = gradacc::optim_kind(name);
  if (p.kind < 0 || num_options > gradacc::kMaxOptions) return -1;
  constexpr int kSlots = gradacc::kMaxStateSlots;
  p.params = emu_entry::spans(lists[0], lengths[0]);
  p.grads = emu_entry::spans(lists[1], lengths[1]);
  for (int s = 0; s < kSlots; ++s) p.state[s] = emu_entry::spans(lists[2 + s], lengths[2 + s]);
  p.masters = emu_entry::spans(lists[2 + kSlots], lengths[2 + kSlots]);
  for (int s = 0; s < kSlots; ++s) p.scales[s] = emu_entry::spans(lists[3 + kSlots + s], lengths[3 + kSlots + s]);
  p.storage = gradacc::StateStorage(storage);
  p.steps.assign(steps, steps + num_steps);
  p.scalars.lr = lr;
  p.scalars.maximize = maximize != 0;
  for (int i = 0; i < num_options; ++i) p.scalars.option[i] = options[i];
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
