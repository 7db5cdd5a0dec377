// Runtime dtype -> static type, usable on host and device. Every tensor of a
// list carries its own dtype, so mixed lists need no grouping by the caller:
// each chunk dispatches on its own tensor's type (uniform within a block).
#pragma once

#include "element_math.cuh"

namespace gradacc {

template <typename F>
GRADACC_HD void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat16: f(Half{}); break;
    case DType::kBFloat16: f(BFloat16{}); break;
    default: f(float{}); break;
  }
}

// The single-list ops (norms, clips) also take float64 tensors.
template <typename F>
GRADACC_HD void dispatch_dtype_f64(DType dtype, F&& f) {
  if (dtype == DType::kFloat64) {
    f(double{});
  } else {
    dispatch_dtype(dtype, f);
  }
}

// Accumulation pairs: the buffer is fp32 or the grad's own dtype.
template <typename F>
GRADACC_HD void dispatch_buf_grad(DType buf, DType grad, F&& f) {
  dispatch_dtype(grad, [&](auto g) {
    using G = decltype(g);
    if (buf == DType::kFloat32) {
      f(float{}, G{});
    } else {
      f(G{}, G{});
    }
  });
}

}  // namespace gradacc
