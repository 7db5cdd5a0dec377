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

// "ok" when that stream can be found in this process, else why not (compiled_info reports it, so that
// `gradacc info` shows it even where no GPU is visible).
std::string stream_lookup_status();

// Runs launch(stream) on `device` (a DeviceGuard sets it current) and its current stream.
template <typename Launch>
void run_on(const Device& device, Launch&& launch) {
  const torch::stable::accelerator::DeviceGuard guard(device.index());
  const cudaError_t err = launch(current_stream(device.index()));
  GRADACC_CHECK(err == cudaSuccess, "CUDA error: ", cudaGetErrorString(err));
}

}  // namespace gradacc::cuda
