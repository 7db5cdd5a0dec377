// CUDA registrations of the core gradacc ops (described in csrc/core_ops.h, defined in csrc/ops.cpp).
//
// Each op: the binding:: function checks every argument and builds the params
// (nothing runs on a bad argument), then the launcher runs on the tensors'
// device and the current stream. No host synchronisation anywhere.
#include <vector>

#include "../binding.h"
#include "../boxing.h"
#include "../core_ops.h"
#include "../stable.h"
#include "launch.h"
#include "stream.h"

namespace gradacc {
namespace {

// Device scratch for a launcher; empty (null pointer) when none is needed.
// The caching allocator keeps it valid for the work queued on the stream.
std::optional<Tensor> workspace(size_t bytes, const Device& device) {
  if (bytes == 0) return std::nullopt;
  const std::vector<int64_t> size{int64_t(bytes)};
  return torch::stable::empty(size, ScalarType::Byte, std::nullopt, device);
}

void* data_or_null(const std::optional<Tensor>& t) { return t ? t->data_ptr() : nullptr; }

using cuda::run_on;

void run_accumulate(const AccumulateParams& p, const Device& device) {
  run_on(device, [&](cudaStream_t stream) {
    const std::optional<Tensor> ws = workspace(cuda::accumulate_workspace_bytes(p), device);
    return cuda::launch_accumulate(p, data_or_null(ws), stream);
  });
}

void accumulate_cuda(const TensorList& bufs, const TensorList& grads, double alpha,
                     const std::optional<Tensor>& alpha_tensor, bool assign) {
  const auto p = binding::accumulate_params(op_label<AccumulateOp>(), bufs, grads, alpha, alpha_tensor, assign);
  if (p.bufs.empty()) return;  // nothing to write
  run_accumulate(p, device_of(bufs[0]));
}

void accumulate_final_cuda(const TensorList& bufs, const TensorList& grads, double alpha,
                           const std::optional<Tensor>& alpha_tensor, bool assign, const Tensor& found_inf,
                           const Tensor& norm_acc, double norm_type) {
  // An empty list adds nothing: the device comes from found_inf, which is always given.
  run_accumulate(binding::accumulate_final_params(op_label<AccumulateFinalOp>(), bufs, grads, alpha, alpha_tensor,
                                                  assign, found_inf, norm_acc, norm_type),
                 found_inf.device());
}

std::tuple<Tensor, Tensor> global_norm_cuda(const TensorList& tensors, double norm_type, bool per_tensor) {
  auto p = binding::norm_params(op_label<GlobalNormOp>(), tensors, norm_type);
  // Only a CUDA tensor in the list routes the op here, so the list is not empty.
  GRADACC_CHECK(!tensors.empty(), op_label<GlobalNormOp>(), ": CUDA kernel called with an empty list");
  auto [total, each] = binding::norm_outputs(tensors, per_tensor, p);
  run_on(device_of(tensors[0]), [&](cudaStream_t stream) {
    const std::optional<Tensor> ws = workspace(cuda::norm_workspace_bytes(p), device_of(tensors[0]));
    return cuda::launch_norm(p, data_or_null(ws), stream);
  });
  return {total, each};
}

void unscale_cuda(const TensorList& tensors, const Tensor& inv_scale, const Tensor& found_inf) {
  const auto p = binding::unscale_params(op_label<UnscaleOp>(), tensors, inv_scale, found_inf);
  run_on(found_inf.device(), [&](cudaStream_t stream) { return cuda::launch_scale(p, stream); });
}

void clip_by_norm_cuda(const TensorList& tensors, const Tensor& total_norm, double max_norm, double eps) {
  const auto p = binding::clip_norm_params(op_label<ClipByNormOp>(), tensors, total_norm, max_norm, eps);
  run_on(total_norm.device(), [&](cudaStream_t stream) { return cuda::launch_scale(p, stream); });
}

void clip_by_value_cuda(const TensorList& tensors, double clip_value) {
  const auto p = binding::clip_value_params(op_label<ClipByValueOp>(), tensors, clip_value);
  if (p.tensors.empty()) return;  // nothing to write
  run_on(device_of(tensors[0]), [&](cudaStream_t stream) { return cuda::launch_scale(p, stream); });
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(gradacc, CUDA, m) {
  impl_op<AccumulateOp, &accumulate_cuda>(m);
  impl_op<AccumulateFinalOp, &accumulate_final_cuda>(m);
  impl_op<GlobalNormOp, &global_norm_cuda>(m);
  impl_op<UnscaleOp, &unscale_cuda>(m);
  impl_op<ClipByNormOp, &clip_by_norm_cuda>(m);
  impl_op<ClipByValueOp, &clip_by_value_cuda>(m);
}

}  // namespace gradacc
