// CUDA registrations of the fused optimizer steps (every optimizer of
// kernels/optim_traits.cuh): binding_optim.cpp reads and checks every
// argument, then the launcher runs on the params' device and the current
// stream. No host synchronisation.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../binding_optim.h"
#include "optim_launch.h"

namespace gradacc {
namespace {

void run_cuda(const OptimParams& p, c10::Device device) {
  const c10::cuda::CUDAGuard guard(device);
  C10_CUDA_CHECK(cuda::launch_optim_step(p, c10::cuda::getCurrentCUDAStream().stream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(gradacc, CUDA, m) { binding::impl_optim_ops(m, &run_cuda); }

}  // namespace gradacc
