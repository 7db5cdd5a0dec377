// Torch-free launcher of the fused optimizer steps (csrc/kernels/optim_step.cuh).
// The params come from csrc/binding_optim.cpp, already checked. Asynchronous
// on `stream`, no host synchronisation, no metadata copied to the device:
// CUDA-graph capturable. Returns the launch status.
#pragma once

#include <cuda_runtime_api.h>

#include "../kernels/optim_params.h"

namespace gradacc::cuda {

cudaError_t launch_optim_step(const OptimParams& p, cudaStream_t stream);

}  // namespace gradacc::cuda
