// In-place rescaling of a list: unscale (with found-inf check), clip by a
// device-side norm, clip by value. Torch-free; same element math as cpu::scale.
#pragma once

#include "dispatch.cuh"
#include "multi_tensor.cuh"
#include "params.h"

namespace gradacc::cuda {

struct ScaleArgs {
  const float* inv_scale_ptr;  // kUnscale
  float* found_inf;            // kUnscale
  const void* norm_ptr;        // kClipNorm: one element of norm_dtype
  double max_norm;             // kClipNorm (rounded to float for non-float64 tensors)
  double eps;                  // kClipNorm
  double clip_value;           // kClipValue
  DType norm_dtype;            // kClipNorm
};
static_assert(sizeof(ListMeta<1>) + sizeof(ScaleArgs) <= kParamLimit, "scale kernel parameters");

// float64 tensors (the clips only: the binding refuses them for unscale_)
// are clipped in double, one element at a time, as the CPU kernel does.
template <ScaleMode kMode>
__global__ void __launch_bounds__(kBlockThreads)
    scale_kernel(const __grid_constant__ ListMeta<1> meta, const ScaleArgs args) {
  float factor = 1.0f;
  double factor_f64 = 1.0;
  if constexpr (kMode == ScaleMode::kUnscale) factor = *args.inv_scale_ptr;
  if constexpr (kMode == ScaleMode::kClipNorm) {
    // Every block derives the coefficient from the device-side norm itself:
    // no host sync. It is the same in every thread, so the exit is uniform.
    factor = clip_coefficient(load_scalar<float>(args.norm_ptr, args.norm_dtype), float(args.max_norm),
                              float(args.eps));
    factor_f64 = clip_coefficient(load_scalar<double>(args.norm_ptr, args.norm_dtype), args.max_norm, args.eps);
    // nothing to clip: leave memory untouched (a NaN coefficient does not exit)
    if (factor >= 1.0f && factor_f64 >= 1.0) return;
  }
  const BlockChunk c = block_chunk(meta);
  bool bad = false;
  dispatch_dtype_f64(meta.dtype[0][c.slot], [&](auto tag) {
    using T = decltype(tag);
    T* x = static_cast<T*>(meta.data[0][c.slot]) + c.first_elem;
    for_each_group(c.n, sizeof(T) < 8 && aligned16(x), [&](auto width, int i) {
      constexpr int W = decltype(width)::value;
      T v[W];
      load_raw<W>(x + i, v);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        if constexpr (std::is_same_v<T, double>) {
          v[k] = kMode == ScaleMode::kClipValue ? clip_value(v[k], args.clip_value) : Arith<double>::mul(v[k], factor_f64);
        } else if constexpr (kMode == ScaleMode::kClipValue) {
          v[k] = Elem<T>::store(clip_value(Elem<T>::load(v[k]), float(args.clip_value)));
        } else {
          const float in = Elem<T>::load(v[k]);
          if constexpr (kMode == ScaleMode::kUnscale) bad |= !is_finite(in);  // the input, like the CPU kernel
          v[k] = Elem<T>::store(mul_rn(in, factor));
        }
      }
      store_raw<W>(x + i, v);
    });
  });
  if constexpr (kMode == ScaleMode::kUnscale) {
    if (__syncthreads_or(bad) && threadIdx.x == 0) *args.found_inf = 1.0f;  // racy 0 -> 1, benign
  }
}

}  // namespace gradacc::cuda
