// Torch-free launchers of the CUDA kernels (csrc/kernels/*.cuh).
//
// The params come from csrc/binding.cpp, already checked. Every launcher is
// asynchronous on `stream`, never synchronises the host and never copies
// metadata to the device, so all are CUDA-graph capturable. Each returns the
// launch status (cudaGetLastError()).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "../kernels/params.h"

namespace gradacc::cuda {

// Scratch for the final step's norm partials: 0 unless p.final_step. The
// caller allocates it on the device (8-byte aligned) and keeps it alive
// until the work on `stream` is done (the caching allocator does).
size_t accumulate_workspace_bytes(const AccumulateParams& p);
cudaError_t launch_accumulate(const AccumulateParams& p, void* workspace, cudaStream_t stream);

// Scratch for the per-chunk partials and chunk -> tensor map (8-byte aligned).
size_t norm_workspace_bytes(const NormParams& p);
cudaError_t launch_norm(const NormParams& p, void* workspace, cudaStream_t stream);

cudaError_t launch_scale(const ScaleParams& p, cudaStream_t stream);

}  // namespace gradacc::cuda
