// Parameter structs of raw pointers, one per op family (flash-attention style).
//
// The binding layer (csrc/binding.cpp) does every tensor check and fills these;
// the CPU kernels and the CUDA launchers trust them completely. Torch-free.
#pragma once

#include <cstdint>
#include <vector>

#include "element_math.cuh"

namespace gradacc {

// One tensor as the kernels see it: `numel` elements in one dense block of
// memory (a contiguous tensor, or a dense permuted one such as channels_last,
// which the element-wise ops and the norms may read in storage order).
struct Span {
  void* data;
  int64_t numel;
  DType dtype;
};

// bufs[i] = (assign ? 0 : bufs[i]) + alpha * (*alpha_ptr) * grads[i]
// With `final_step` (a bucket of the window's last fold), additionally: raise *found_inf to 1 on a
// non-finite result and ADD the results' partial norm into *norm_acc: their sum of squares (kL2) or
// max |x| (kInf, NaN-propagating). The results stay scaled; the caller takes sqrt and inv_scale once.
struct AccumulateParams {
  std::vector<Span> bufs;
  std::vector<Span> grads;  // same length and numel as bufs
  float alpha = 1.0f;
  const float* alpha_ptr = nullptr;  // optional device/host scalar, multiplies alpha
  bool assign = false;

  bool final_step = false;
  float* found_inf = nullptr;  // required when final_step
  float* norm_acc = nullptr;   // required when final_step: the running partial, added to
  NormKind norm_kind = NormKind::kL2;
};

// Global norm of a tensor list, and optionally each tensor's own norm.
// `wide` (the list holds a float64 tensor): accumulate in double, and the
// outputs are doubles; otherwise fp32 accumulation and float outputs.
struct NormParams {
  std::vector<Span> tensors;
  NormKind norm_kind = NormKind::kL2;
  double p = 2.0;                  // the order, used by NormKind::kP
  bool wide = false;
  void* total_out = nullptr;       // one float (double if wide)
  void* per_tensor_out = nullptr;  // tensors.size() of them, or null
};

// In-place element-wise rescaling of a list; the mode picks the element op.
enum class ScaleMode : int8_t {
  kUnscale = 0,    // x *= *inv_scale_ptr; raise *found_inf on non-finite
  kClipNorm = 1,   // x *= clip_coefficient(total norm, max_norm, eps) (in double for float64 x), skipped when >= 1
  kClipValue = 2,  // x = clamp(x, -clip_value, clip_value)
};

struct ScaleParams {
  std::vector<Span> tensors;
  ScaleMode mode = ScaleMode::kUnscale;
  const float* inv_scale_ptr = nullptr;
  float* found_inf = nullptr;
  const void* norm_ptr = nullptr;  // a one-element scalar of any float dtype
  DType norm_dtype = DType::kFloat32;
  // As given: float64 tensors use them in double, the others rounded to float.
  double max_norm = 0.0;
  double eps = 0.0;
  double clip_value = 0.0;
};

}  // namespace gradacc
