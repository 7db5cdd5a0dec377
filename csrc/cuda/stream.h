// The CUDA side of the stable ABI, shared by both registration files: run a
// launcher on a device and its current stream, and turn a launch error into
// an exception.
#pragma once

#include <cuda_runtime_api.h>
#include <torch/csrc/stable/accelerator.h>

#include "../stable.h"

namespace gradacc::cuda {

// torch's current stream on `device_index` (stream.cpp says where it comes from).
cudaStream_t current_stream(int32_t device_index);

// Runs launch(stream) on `device` (a DeviceGuard sets it current) and its current stream.
template <typename Launch>
void run_on(const Device& device, Launch&& launch) {
  const torch::stable::accelerator::DeviceGuard guard(device.index());
  const cudaError_t err = launch(current_stream(device.index()));
  GRADACC_CHECK(err == cudaSuccess, "CUDA error: ", cudaGetErrorString(err));
}

}  // namespace gradacc::cuda
