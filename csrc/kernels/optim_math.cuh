// Per-element math of the fused optimizer steps that every optimizer shares
// (loads and stores in the compute type, torch's lerp and maximum, stochastic
// rounding), for the CPU kernels (g++) and the CUDA kernels (nvcc); each
// optimizer's own update is in optim_traits.cuh. Torch-free.
//
// The compute type C is float, or double for fp64 params (their state is
// fp64 too). The updates follow torch.optim operation by operation, every
// operation rounded on its own (no FMA contraction, see element_math.cuh),
// so fp32 results stay within a few ulps of torch's.
#pragma once

#include "element_math.cuh"

// The per-element step functions are big enough that GCC may decline to
// inline them, and an out-of-line call in the loop stops its vectorisation.
#if defined(__CUDACC__)
#define GRADACC_STEP_HD __host__ __device__ __forceinline__
#else
#define GRADACC_STEP_HD inline __attribute__((always_inline))
#endif

namespace gradacc {

// ---- loads and stores in the compute type -------------------------------

// Loads use element_math.cuh's load_as<C>(x) (16-bit and fp32 values widen exactly).

// Round-to-nearest store of a compute value into T.
template <typename T, typename C>
GRADACC_HD T store_as(C x) {
  return Elem<T>::store(float(x));
}
template <>
GRADACC_HD double store_as<double, double>(double x) {
  return x;
}

// torch.maximum: NaN in either operand gives NaN.
template <typename C>
GRADACC_HD C maximum_nan(C a, C b) {
  return (a != a || a > b) ? a : b;
}

// torch's lerp: start + w * (end - start), or the form exact at w = 1.
template <typename C>
GRADACC_STEP_HD C lerp(C start, C end, C w) {
  const C diff = add_rn(end, -start);
  return w < C(0.5) ? add_rn(start, mul_rn(w, diff)) : add_rn(end, -mul_rn(diff, add_rn(C(1), -w)));
}

// ---- Stochastic rounding of 16-bit params ---------------------------------

// splitmix64: a counter-based generator, so the random bits of an element
// depend only on (seed, step, the element's position), never on threads,
// launches or the device: the CPU and CUDA kernels draw the same bits.
GRADACC_HD uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The stream of one step: elements draw splitmix64(stream + position).
GRADACC_HD uint64_t rounding_stream(int64_t seed, float step) {
  return splitmix64(splitmix64(uint64_t(seed)) ^ uint64_t(uint32_t(step)));
}

// fp32 -> bf16 rounding up with probability (x - down) / (up - down): add
// 16 random bits below bf16's last bit, then truncate. Inf stays Inf, NaN
// stays a quiet NaN.
GRADACC_HD BFloat16 stochastic_bf16(float x, uint32_t r) {
  if (!is_finite(x)) return float_to_bf16(x);
  return BFloat16{uint16_t((float_bits(x) + (r & 0xFFFFu)) >> 16)};
}

// fp32 -> fp16 likewise, from the two fp16 neighbours of |x| (magnitudes
// beyond fp16's range saturate to the largest finite value, as rounding
// down is then the only neighbour).
GRADACC_HD Half stochastic_half(float x, uint32_t r) {
  const Half nearest = float_to_half(x);
  const float a = abs_f(x);
  const uint16_t mag = uint16_t(nearest.bits & 0x7FFFu);
  const float fmag = half_to_float(Half{mag});
  if (!is_finite(x) || fmag == a) return nearest;
  const uint16_t lo = fmag > a ? uint16_t(mag - 1) : mag;
  const uint16_t hi = uint16_t(lo + 1);
  const float flo = half_to_float(Half{lo});
  const float fhi = half_to_float(Half{hi});
  const float p_up = is_finite(fhi) ? div_rn(add_rn(a, -flo), add_rn(fhi, -flo)) : 0.0f;
  const float u = mul_rn(float(r >> 8), 5.9604644775390625e-8f);  // uniform in [0, 1), 24 bits
  const uint16_t sign = uint16_t(nearest.bits & 0x8000u);
  return Half{uint16_t(sign | (u < p_up ? hi : lo))};
}

template <typename T> struct Stochastic;
template <> struct Stochastic<BFloat16> {
  GRADACC_HD static BFloat16 store(float x, uint32_t r) { return stochastic_bf16(x, r); }
};
template <> struct Stochastic<Half> {
  GRADACC_HD static Half store(float x, uint32_t r) { return stochastic_half(x, r); }
};

}  // namespace gradacc
