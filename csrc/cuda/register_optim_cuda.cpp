// CUDA registrations of the fused optimizer steps (every optimizer of
// kernels/optim_traits.cuh): binding_optim.cpp reads and checks every
// argument, then the launcher runs on the params' device and the current
// stream. No host synchronisation.
#include "../binding_optim.h"
#include "optim_launch.h"
#include "stream.h"

namespace gradacc {
namespace {

void run_cuda(const OptimParams& p, const Device& device) {
  cuda::run_on(device, [&](cudaStream_t stream) { return cuda::launch_optim_step(p, stream); });
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(gradacc, CUDA, m) { binding::impl_optim_ops<run_cuda>(m); }

}  // namespace gradacc
