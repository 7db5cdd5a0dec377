#include "binding.h"

#include "aliasing.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

namespace gradacc::binding {
namespace {

DType to_dtype(const char* op, const char* arg, int64_t i, ScalarType st, Use use) {
  switch (st) {
    case ScalarType::Float: return DType::kFloat32;
    case ScalarType::Half: return DType::kFloat16;
    case ScalarType::BFloat16: return DType::kBFloat16;
    case ScalarType::Double:
      if (use != Use::kPaired) return DType::kFloat64;
      break;
    case ScalarType::Byte:
      if (use == Use::kStepState) return DType::kUInt8;
      break;
    default: break;
  }
  fail(op, ": ", arg, "[", i, "] has dtype ", dtype_name(st), "; expected ",
       use == Use::kPaired      ? "float32, float16 or bfloat16"
       : use == Use::kStepState ? "float32, float16, bfloat16, float64 or uint8"
                                : "float32, float16, bfloat16 or float64");
}

// The accumulate final step computes its norm beside the found-inf flag,
// which needs max |x|: only the L2 / inf fast path.
NormKind to_fast_norm_kind(const char* op, double norm_type) {
  if (norm_type == 2.0) return NormKind::kL2;
  if (std::isinf(norm_type) && norm_type > 0) return NormKind::kInf;
  fail(op, ": norm_type must be 2.0 or inf, got ", norm_type);
}

// Any order torch.linalg.vector_norm takes.
NormKind to_norm_kind(const char* op, double norm_type) {
  GRADACC_CHECK(!std::isnan(norm_type), op, ": norm_type must be a number or +-inf, got ", norm_type);
  if (norm_type == 2.0) return NormKind::kL2;
  if (std::isinf(norm_type)) return norm_type > 0 ? NormKind::kInf : NormKind::kNegInf;
  if (norm_type == 0.0) return NormKind::kZero;
  if (norm_type == 1.0) return NormKind::kOne;
  return NormKind::kP;
}

DType to_scalar_dtype(const char* op, const char* arg, ScalarType st) {
  switch (st) {
    case ScalarType::Float: return DType::kFloat32;
    case ScalarType::Half: return DType::kFloat16;
    case ScalarType::BFloat16: return DType::kBFloat16;
    case ScalarType::Double: return DType::kFloat64;
    default:
      fail(op, ": ", arg, " has dtype ", dtype_name(st), "; expected a one-element floating-point tensor");
  }
}

void check_finite_scalar(const char* op, const char* arg, double v) {
  GRADACC_CHECK(std::isfinite(v), op, ": ", arg, " must be finite, got ", v);
}

// The kernels compute in float32: a finite double beyond its range would turn
// into inf silently (eps=1e39 zeroes every grad), so it is an error. Inf and
// NaN pass through; the op's own checks decide whether they are allowed.
float to_float(const char* op, const char* arg, double v) {
  constexpr double kMax = std::numeric_limits<float>::max();
  GRADACC_CHECK(!std::isfinite(v) || std::fabs(v) <= kMax, op, ": ", arg, " = ", v,
                " does not fit in float32, the kernels' type; expected |", arg, "| <= ", kMax);
  return float(v);
}

// A clip argument as the kernels use it: float64 tensors take it in double,
// every other tensor rounds it to float, so it must fit in float32 unless the
// list is all float64.
double list_value(const char* op, const char* arg, double v, const std::vector<Span>& spans) {
  const bool all_double = !spans.empty() && std::all_of(spans.begin(), spans.end(), [](const Span& s) {
    return s.dtype == DType::kFloat64;
  });
  if (!all_double) to_float(op, arg, v);
  return v;
}

}  // namespace

// ---- the per-tensor checks, shared with binding_optim.cpp (declared in binding.h) ----

Span check_tensor(const char* op, const char* arg, int64_t i, TensorRef t, const Device& device, Use use,
                  torch::headeronly::IntHeaderOnlyArrayRef* sizes) {
  const TensorFacts f = facts_of(t, sizes != nullptr);
  GRADACC_CHECK(f.defined, op, ": ", arg, "[", i, "] is undefined (None)");
  GRADACC_CHECK(f.strided, op, ": ", arg, "[", i, "] has layout ", layout_name(layout_of(t)),
                "; expected a dense (strided) tensor");
  GRADACC_CHECK(f.device_type == device.type() && f.device_index == device.index(), op, ": ", arg, "[", i,
                "] is on ", device_name(f.device()), " but the tensors are on ", device_name(device),
                "; all tensors must be on one device");
  const DType dtype = to_dtype(op, arg, i, f.dtype, use);
  if (!f.contiguous) {  // strides are read only here: the common case never needs them
    const Shape shape = shape_of(t);
    GRADACC_CHECK(use == Use::kSingleList, op, ": ", arg, "[", i, "] is not contiguous (sizes ",
                  shape_str(shape.sizes), ", strides ", shape_str(shape.strides), "); expected a contiguous tensor");
    GRADACC_CHECK(is_non_overlapping_and_dense(shape), op, ": ", arg, "[", i, "] is not dense (sizes ",
                  shape_str(shape.sizes), ", strides ", shape_str(shape.strides),
                  "); expected a dense non-overlapping tensor, such as a contiguous or channels_last one");
  }
  if (sizes != nullptr) *sizes = f.sizes;
  return Span{data_of(t), f.numel, dtype};  // read last, as before: the checks above name a bad tensor first
}

std::vector<Span> check_list(const char* op, const char* arg, const TensorList& list, const Device& device, Use use,
                             std::vector<torch::headeronly::IntHeaderOnlyArrayRef>* sizes) {
  std::vector<Span> spans;
  spans.reserve(list.size());
  if (sizes != nullptr) sizes->resize(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    spans.push_back(check_tensor(op, arg, int64_t(i), list[i], device, use, sizes ? &(*sizes)[i] : nullptr));
  }
  return spans;
}

void check_scalar(const char* op, const char* arg, TensorRef t, const Device& device) {
  GRADACC_CHECK(is_defined(t), op, ": ", arg, " is undefined (None)");
  const ScalarType dtype = dtype_of(t);
  GRADACC_CHECK(dtype == ScalarType::Float, op, ": ", arg, " has dtype ", dtype_name(dtype),
                "; expected a one-element float32 tensor");
  const int64_t numel = numel_of(t);
  GRADACC_CHECK(is_strided(t) && numel == 1, op, ": ", arg, " has ", numel,
                " elements; expected a one-element float32 tensor");
  const Device on = device_of(t);
  GRADACC_CHECK(on == device, op, ": ", arg, " is on ", device_name(on), " but the tensors are on ",
                device_name(device), "; expected it on the same device");
}

void check_same_shape(const char* op, const char* arg, int64_t i, torch::headeronly::IntHeaderOnlyArrayRef shape,
                      const char* ref_arg, torch::headeronly::IntHeaderOnlyArrayRef ref_shape) {
  GRADACC_CHECK(shape.equals(ref_shape), op, ": ", arg, "[", i, "] has shape ", shape_str(shape), " but ", ref_arg,
                "[", i, "] has shape ", shape_str(ref_shape), "; expected equal shapes");
}

void check_pair_dtype(bool ok, const char* op, const char* arg, int64_t i, TensorRef t, const char* ref_arg,
                      TensorRef ref, const char* expected) {
  GRADACC_CHECK(ok, op, ": ", arg, "[", i, "] has dtype ", dtype_name(dtype_of(t)), " but ", ref_arg, "[", i,
                "] has dtype ", dtype_name(dtype_of(ref)), "; expected ", expected);
}

Device list_device(const TensorList& list, const Tensor* fallback) {
  for (size_t i = 0; i < list.size(); ++i) {
    if (is_defined(list[i])) return device_of(list[i]);
  }
  return fallback != nullptr ? device_of(*fallback) : Device(torch::headeronly::DeviceType::CPU);
}

// ---- the ops ----

namespace {

// accumulate_'s checks but the one-tensor arguments' memory check, which each op makes over all its tensors.
AccumulateParams checked_accumulate(const char* op, const TensorList& bufs, const TensorList& grads, double alpha,
                                    const std::optional<Tensor>& alpha_tensor, bool assign) {
  GRADACC_CHECK(bufs.size() == grads.size(), op, ": bufs and grads must have the same length, got ",
                bufs.size(), " and ", grads.size());
  const Device device = list_device(bufs, alpha_tensor ? &*alpha_tensor : nullptr);
  AccumulateParams p;
  std::vector<torch::headeronly::IntHeaderOnlyArrayRef> buf_sizes, grad_sizes;
  p.bufs = check_list(op, "bufs", bufs, device, Use::kPaired, &buf_sizes);
  p.grads = check_list(op, "grads", grads, device, Use::kPaired, &grad_sizes);
  check_disjoint(op, {{"bufs", &p.bufs}}, {{"grads", &p.grads}}, true);
  for (size_t i = 0; i < bufs.size(); ++i) {
    check_same_shape(op, "grads", int64_t(i), grad_sizes[i], "bufs", buf_sizes[i]);
    const bool ok = p.bufs[i].dtype == DType::kFloat32 || p.bufs[i].dtype == p.grads[i].dtype;
    check_pair_dtype(ok, op, "bufs", int64_t(i), bufs[i], "grads", grads[i], "float32 or its grad's dtype");
  }
  check_finite_scalar(op, "alpha", alpha);
  if (alpha_tensor) {
    check_scalar(op, "alpha_tensor", *alpha_tensor, device);
    p.alpha_ptr = alpha_tensor->mutable_data_ptr<float>();
  }
  p.alpha = to_float(op, "alpha", alpha);
  p.assign = assign;
  return p;
}

}  // namespace

// bufs[i] may be grads[i] itself: bufs[i] += alpha * bufs[i] is elementwise (aliasing.h).
AccumulateParams accumulate_params(const char* op, const TensorList& bufs, const TensorList& grads, double alpha,
                                   const std::optional<Tensor>& alpha_tensor, bool assign) {
  AccumulateParams p = checked_accumulate(op, bufs, grads, alpha, alpha_tensor, assign);
  const std::vector<Span> alpha_span = scalar_span(p.alpha_ptr);
  check_scalars_disjoint(op, {{"bufs", &p.bufs}}, {{"grads", &p.grads}, scalar_arg("alpha_tensor", alpha_span)});
  return p;
}

AccumulateParams accumulate_final_params(const char* op, const TensorList& bufs, const TensorList& grads, double alpha,
                                         const std::optional<Tensor>& alpha_tensor, bool assign,
                                         const Tensor& found_inf, const Tensor& norm_acc, double norm_type) {
  AccumulateParams p = checked_accumulate(op, bufs, grads, alpha, alpha_tensor, assign);
  const Device device = list_device(bufs, &norm_acc);
  check_scalar(op, "found_inf", found_inf, device);
  check_scalar(op, "norm_acc", norm_acc, device);
  p.final_step = true;
  p.found_inf = found_inf.mutable_data_ptr<float>();
  p.norm_acc = norm_acc.mutable_data_ptr<float>();
  p.norm_kind = to_fast_norm_kind(op, norm_type);
  const std::vector<Span> found = scalar_span(p.found_inf), norm = scalar_span(p.norm_acc),
                          alpha_span = scalar_span(p.alpha_ptr);
  check_scalars_disjoint(op, {{"bufs", &p.bufs}, scalar_arg("found_inf", found), scalar_arg("norm_acc", norm)},
                         {{"grads", &p.grads}, scalar_arg("alpha_tensor", alpha_span)});
  return p;
}

NormParams norm_params(const char* op, const TensorList& tensors, double norm_type) {
  NormParams p;
  p.tensors = check_list(op, "tensors", tensors, list_device(tensors, nullptr), Use::kSingleList);
  p.norm_kind = to_norm_kind(op, norm_type);
  p.p = norm_type;
  for (const Span& s : p.tensors) p.wide = p.wide || s.dtype == DType::kFloat64;
  return p;
}

std::pair<Tensor, Tensor> norm_outputs(const TensorList& tensors, bool per_tensor, NormParams& params) {
  const ScalarType dtype = params.wide ? ScalarType::Double : ScalarType::Float;
  const Device device = list_device(tensors, nullptr);
  const std::vector<int64_t> scalar, each_size{per_tensor ? int64_t(tensors.size()) : 0};
  Tensor total = torch::stable::empty(scalar, dtype, std::nullopt, device);
  Tensor each = torch::stable::empty(each_size, dtype, std::nullopt, device);
  params.total_out = total.data_ptr();
  params.per_tensor_out = per_tensor ? each.data_ptr() : nullptr;
  return {total, each};
}

ScaleParams unscale_params(const char* op, const TensorList& tensors, const Tensor& inv_scale,
                           const Tensor& found_inf) {
  const Device device = list_device(tensors, &found_inf);
  ScaleParams p;
  p.tensors = check_list(op, "tensors", tensors, device, Use::kPaired);
  check_disjoint(op, {{"tensors", &p.tensors}}, {});
  check_scalar(op, "inv_scale", inv_scale, device);
  check_scalar(op, "found_inf", found_inf, device);
  p.mode = ScaleMode::kUnscale;
  p.inv_scale_ptr = inv_scale.mutable_data_ptr<float>();
  p.found_inf = found_inf.mutable_data_ptr<float>();
  const std::vector<Span> found = scalar_span(p.found_inf), inv = scalar_span(p.inv_scale_ptr);
  check_scalars_disjoint(op, {{"tensors", &p.tensors}, scalar_arg("found_inf", found)}, {scalar_arg("inv_scale", inv)});
  return p;
}

ScaleParams clip_norm_params(const char* op, const TensorList& tensors, const Tensor& total_norm, double max_norm,
                             double eps) {
  const Device device = list_device(tensors, &total_norm);
  ScaleParams p;
  p.tensors = check_list(op, "tensors", tensors, device, Use::kSingleList);
  check_disjoint(op, {{"tensors", &p.tensors}}, {});
  // total_norm: one element of any float dtype (torch's get_total_norm returns the grads' dtype).
  GRADACC_CHECK(is_defined(total_norm), op, ": total_norm is undefined (None)");
  const DType norm_dtype = to_scalar_dtype(op, "total_norm", dtype_of(total_norm));
  const int64_t norm_numel = numel_of(total_norm);
  GRADACC_CHECK(is_strided(total_norm) && norm_numel == 1, op, ": total_norm has ", norm_numel,
                " elements; expected a one-element floating-point tensor");
  const Device norm_device = device_of(total_norm);
  GRADACC_CHECK(norm_device == device, op, ": total_norm is on ", device_name(norm_device),
                " but the tensors are on ", device_name(device), "; expected it on the same device");
  // inf measures without clipping, 0 zeroes the tensors: torch's semantics.
  GRADACC_CHECK(max_norm >= 0, op, ": max_norm must be >= 0 (inf allowed), got ", max_norm);
  GRADACC_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, got ", eps);
  p.mode = ScaleMode::kClipNorm;
  p.norm_ptr = total_norm.data_ptr();
  p.norm_dtype = norm_dtype;
  p.max_norm = list_value(op, "max_norm", max_norm, p.tensors);
  p.eps = list_value(op, "eps", eps, p.tensors);
  const std::vector<Span> norm{Span{const_cast<void*>(p.norm_ptr), 1, norm_dtype}};
  check_scalars_disjoint(op, {{"tensors", &p.tensors}}, {scalar_arg("total_norm", norm)});
  return p;
}

ScaleParams clip_value_params(const char* op, const TensorList& tensors, double clip_value) {
  ScaleParams p;
  p.tensors = check_list(op, "tensors", tensors, list_device(tensors, nullptr), Use::kSingleList);
  check_disjoint(op, {{"tensors", &p.tensors}}, {});
  // 0 zeroes, inf keeps, a negative value sets every element to it: torch.clamp's semantics.
  GRADACC_CHECK(!std::isnan(clip_value), op, ": clip_value must not be NaN, got ", clip_value);
  p.mode = ScaleMode::kClipValue;
  p.clip_value = list_value(op, "clip_value", clip_value, p.tensors);
  return p;
}

}  // namespace gradacc::binding
