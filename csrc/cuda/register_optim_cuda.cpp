// CUDA registrations of the fused optimizer steps (every optimizer of
// kernels/optim_traits.cuh): binding_optim.cpp reads and checks every
// argument, then the launcher runs on the params' device and the current
// stream. No host synchronisation.
#include "../binding_optim.h"
#include "optim_launch.h"
#include "stream.h"

namespace gradacc {
namespace {

// int8 AdamW states on CUDA take float32 grads only (optim_step.cuh's kInt8NeedsFp32Grads says why):
// refused here, before anything is written.
void check_int8_adamw_grads(const OptimParams& p) {
  if (p.storage != StateStorage::kInt8 || p.kind != kKindOf<AdamW>) return;
  for (size_t i = 0; i < p.grads.size(); ++i) {
    GRADACC_CHECK(p.grads[i].dtype == DType::kFloat32, "gradacc.adamw_step_: int8 states (uint8 exp_avgs) on CUDA ",
                  "take float32 grads, got a 16-bit grads[", i, "]: accumulate into float32 buffers ",
                  "(GradientAccumulator's default) or use bf16 states");
  }
}

void run_cuda(const OptimParams& p, const Device& device) {
  check_int8_adamw_grads(p);
  cuda::run_on(device, [&](cudaStream_t stream) { return cuda::launch_optim_step(p, stream); });
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(gradacc, CUDA, m) { binding::impl_optim_ops<run_cuda>(m); }

}  // namespace gradacc
