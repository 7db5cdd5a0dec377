// The CUDA side of the stable ABI, shared by both registration files: run a
// launcher on a device and its current stream, and turn a launch error into
// an exception. Targeting torch 2.11, the current stream comes from the C
// shim's aoti_torch_get_current_cuda_stream (in libtorch_cuda, resolved when
// _C loads beside a CUDA torch): torch::stable's Stream::nativeHandle() needs 2.13.
#pragma once

#include <cuda_runtime_api.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>

#include "../stable.h"

namespace gradacc::cuda {

// Runs launch(stream) on `device` (a DeviceGuard sets it current) and its current stream.
template <typename Launch>
void run_on(const Device& device, Launch&& launch) {
  const torch::stable::accelerator::DeviceGuard guard(device.index());
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device.index(), &stream));
  const cudaError_t err = launch(static_cast<cudaStream_t>(stream));
  GRADACC_CHECK(err == cudaSuccess, "CUDA error: ", cudaGetErrorString(err));
}

}  // namespace gradacc::cuda
