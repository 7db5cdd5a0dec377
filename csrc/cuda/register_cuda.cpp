// CUDA registrations of the gradacc ops (schemas in csrc/ops.cpp).
//
// Each op: the binding:: function checks every argument and builds the params
// (nothing runs on a bad argument), then the launcher runs on the tensors'
// device and the current stream. No host synchronisation anywhere.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // not ATen/cuda/CUDAContext.h: that one needs the cuBLAS/cuSPARSE headers
#include <torch/library.h>

#include "../binding.h"
#include "launch.h"

namespace gradacc {
namespace {

// Device scratch for a launcher; empty (null pointer) when none is needed.
// The caching allocator keeps it valid for the work queued on the stream.
at::Tensor workspace(size_t bytes, const at::Device& device) {
  if (bytes == 0) return at::Tensor();
  return at::empty({int64_t(bytes)}, at::TensorOptions().dtype(at::kByte).device(device));
}

void* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// Runs launch(stream) on `device` and turns a launch error into an exception.
template <typename Launch>
void run_on(const at::Device& device, Launch&& launch) {
  const c10::cuda::CUDAGuard guard(device);
  C10_CUDA_CHECK(launch(c10::cuda::getCurrentCUDAStream().stream()));
}

void run_accumulate(const AccumulateParams& p, const at::Device& device) {
  run_on(device, [&](cudaStream_t stream) {
    const at::Tensor ws = workspace(cuda::accumulate_workspace_bytes(p), device);
    return cuda::launch_accumulate(p, data_or_null(ws), stream);
  });
}

void accumulate_cuda(at::TensorList bufs, at::TensorList grads, double alpha,
                     const std::optional<at::Tensor>& alpha_tensor, bool assign) {
  const auto p = binding::accumulate_params("gradacc.accumulate_", bufs, grads, alpha, alpha_tensor, assign);
  if (p.bufs.empty()) return;  // nothing to write
  run_accumulate(p, bufs[0].device());
}

void accumulate_final_cuda(at::TensorList bufs, at::TensorList grads, double alpha,
                           const std::optional<at::Tensor>& alpha_tensor, bool assign,
                           const std::optional<at::Tensor>& inv_scale, const at::Tensor& found_inf,
                           const at::Tensor& norm_out, double norm_type) {
  // Even an empty list writes norm_out (0), so the device comes from found_inf.
  run_accumulate(binding::accumulate_final_params("gradacc.accumulate_final_", bufs, grads, alpha, alpha_tensor,
                                                  assign, inv_scale, found_inf, norm_out, norm_type),
                 found_inf.device());
}

std::tuple<at::Tensor, at::Tensor> global_norm_cuda(at::TensorList tensors, double norm_type, bool per_tensor) {
  auto p = binding::norm_params("gradacc.global_norm", tensors, norm_type);
  // Only a CUDA tensor in the list routes the op here, so the list is not empty.
  TORCH_INTERNAL_ASSERT(!tensors.empty(), "gradacc.global_norm: CUDA kernel called with an empty list");
  auto [total, each] = binding::norm_outputs(tensors, per_tensor, p);
  run_on(tensors[0].device(), [&](cudaStream_t stream) {
    const at::Tensor ws = workspace(cuda::norm_workspace_bytes(p), tensors[0].device());
    return cuda::launch_norm(p, data_or_null(ws), stream);
  });
  return {total, each};
}

void unscale_cuda(at::TensorList tensors, const at::Tensor& inv_scale, const at::Tensor& found_inf) {
  const auto p = binding::unscale_params("gradacc.unscale_", tensors, inv_scale, found_inf);
  run_on(found_inf.device(), [&](cudaStream_t stream) { return cuda::launch_scale(p, stream); });
}

void clip_by_norm_cuda(at::TensorList tensors, const at::Tensor& total_norm, double max_norm, double eps) {
  const auto p = binding::clip_norm_params("gradacc.clip_by_norm_", tensors, total_norm, max_norm, eps);
  run_on(total_norm.device(), [&](cudaStream_t stream) { return cuda::launch_scale(p, stream); });
}

void clip_by_value_cuda(at::TensorList tensors, double clip_value) {
  const auto p = binding::clip_value_params("gradacc.clip_by_value_", tensors, clip_value);
  if (p.tensors.empty()) return;  // nothing to write
  run_on(tensors[0].device(), [&](cudaStream_t stream) { return cuda::launch_scale(p, stream); });
}

}  // namespace

TORCH_LIBRARY_IMPL(gradacc, CUDA, m) {
  m.impl("accumulate_", &accumulate_cuda);
  m.impl("accumulate_final_", &accumulate_final_cuda);
  m.impl("global_norm", &global_norm_cuda);
  m.impl("unscale_", &unscale_cuda);
  m.impl("clip_by_norm_", &clip_by_norm_cuda);
  m.impl("clip_by_value_", &clip_by_value_cuda);
}

}  // namespace gradacc
