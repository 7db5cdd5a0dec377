// What the C entry points of the host emulation share (emu_ops.cpp,
// emu_optim.cpp): spans from ctypes, device scratch, the error report.
#pragma once

#include <cuda_runtime_api.h>  // the shim

#include <cstring>
#include <string>
#include <vector>

#include "../kernels/params.h"  // resolved through -I csrc/cuda

namespace emu_entry {

struct EmuSpan {
  void* data;
  int64_t numel;
  int32_t dtype;  // gradacc::DType
};

inline std::vector<gradacc::Span> spans(const EmuSpan* s, int64_t n) {
  std::vector<gradacc::Span> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(gradacc::Span{s[i].data, s[i].numel, gradacc::DType(s[i].dtype)});
  return out;
}

// Device scratch stands in as host memory, 8-byte aligned like the allocator's.
inline std::vector<uint64_t> workspace(size_t bytes) { return std::vector<uint64_t>((bytes + 7) / 8); }

// 0, or the launch's error status with the emulator's message copied into `err`.
inline int finish(cudaError_t status, char* err, size_t err_len) {
  const cudaError_t pending = cudaGetLastError();
  if (status == cudaSuccess) status = pending;
  if (status == cudaSuccess) return 0;
  const std::string msg = emu::last_error().empty() ? "cuda error " + std::to_string(int(status)) : emu::last_error();
  std::strncpy(err, msg.c_str(), err_len - 1);
  err[err_len - 1] = '\0';
  emu::last_error().clear();
  return int(status);
}

}  // namespace emu_entry
