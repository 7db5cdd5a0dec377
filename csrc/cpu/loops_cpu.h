// Loop shapes of the CPU kernels that every ISA variant vectorises (isa.h).
//
// The arithmetic is the shared scalar element math (element_math.cuh); these
// helpers only arrange it so the compiler can use the variant's vectors, and
// convert fp16 with F16C where the variant has it. F16C is bit-identical to
// half_to_float / float_to_half: both convert exactly or round to nearest
// even, subnormals included; only NaN payloads differ, so a block holding a
// NaN is converted by float_to_half itself. (AVX512_BF16's conversion is
// not used: it flushes subnormals to zero; bf16 vectorises as integer math.)
// Included by the per-ISA kernel files only, so every helper lives in that
// ISA's namespace and no variant's copy can replace another's at link time.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "../kernels/element_math.cuh"
#include "isa.h"

namespace gradacc::cpu::GRADACC_CPU_ISA {

// Elements converted per step of a blocked loop: 256 B of floats, in L1.
constexpr int64_t kBlock = 64;

template <typename T>
inline void load_block(const T* __restrict x, float* __restrict out, int64_t m) {
  for (int64_t i = 0; i < m; ++i) out[i] = Elem<T>::load(x[i]);
}

template <typename T>
inline void store_block(const float* __restrict v, T* __restrict x, int64_t m) {
  for (int64_t i = 0; i < m; ++i) x[i] = Elem<T>::store(v[i]);
}

// Types whose loops run as blocks of converted floats: the conversion and
// the op then vectorise separately (GCC vectorises the shared bf16
// conversions alone, but not inside every op's loop below AVX-512).
template <typename T>
constexpr bool kBlocked = false;
template <>
constexpr bool kBlocked<BFloat16> = true;

#if defined(__F16C__)
template <>
constexpr bool kBlocked<Half> = true;

// F16C converts kHalfStep values at a time, as wide as the variant's
// vectors (a narrower store followed by a wider load of the same floats
// would stall store forwarding). Returns false, writing nothing, when the
// floats hold a NaN. (The maskz forms with a full mask are the plain
// conversions; GCC 12 warns about its own headers' unmasked ones.)
#if defined(__AVX512F__)
constexpr int64_t kHalfStep = 16;
inline void half_step_load(const Half* x, float* out) {
  _mm512_storeu_ps(out, _mm512_maskz_cvtph_ps(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))));
}
inline bool half_step_store(const float* v, Half* x) {
  const __m512 f = _mm512_loadu_ps(v);
  if (_mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q) != 0) return false;
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), _mm512_maskz_cvtps_ph(0xFFFF, f, _MM_FROUND_TO_NEAREST_INT));
  return true;
}
#else
constexpr int64_t kHalfStep = 8;
inline void half_step_load(const Half* x, float* out) {
  _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))));
}
inline bool half_step_store(const float* v, Half* x) {
  const __m256 f = _mm256_loadu_ps(v);
  const __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
  if (!_mm256_testz_ps(nan, nan)) return false;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(x), _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
  return true;
}
#endif

// A block of another size than a multiple of kHalfStep (the tail of a
// tensor) takes the shared scalar functions, and so does a step with a NaN.
template <>
inline void load_block<Half>(const Half* __restrict x, float* __restrict out, int64_t m) {
  if (m % kHalfStep != 0) {
    for (int64_t i = 0; i < m; ++i) out[i] = half_to_float(x[i]);
    return;
  }
  for (int64_t i = 0; i < m; i += kHalfStep) half_step_load(x + i, out + i);
}

template <>
inline void store_block<Half>(const float* __restrict v, Half* __restrict x, int64_t m) {
  if (m % kHalfStep != 0) {
    for (int64_t i = 0; i < m; ++i) x[i] = float_to_half(v[i]);
    return;
  }
  for (int64_t i = 0; i < m; i += kHalfStep) {
    if (!half_step_store(v + i, x + i)) {
      for (int64_t l = i; l < i + kHalfStep; ++l) x[l] = float_to_half(v[l]);
    }
  }
}
#endif

// Calls step(i, m) on [i, i + m) blocks covering [0, n): full kBlock blocks
// first, whose constant size lets the compiler unroll and vectorise them.
template <typename Step>
inline void for_blocks(int64_t n, Step&& step) {
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) step(i, kBlock);
  if (i < n) step(i, n - i);
}

// x[i] = store(f(load(x[i]))) for i < n.
template <typename T, typename F>
inline void map_inplace(T* x, int64_t n, F&& f) {
  if constexpr (!kBlocked<T>) {
    for (int64_t i = 0; i < n; ++i) x[i] = Elem<T>::store(f(Elem<T>::load(x[i])));
  } else {
    for_blocks(n, [&](int64_t i, int64_t m) __attribute__((always_inline)) {
      float v[kBlock];
      load_block(x + i, v, m);
      for (int64_t j = 0; j < m; ++j) v[j] = f(v[j]);
      store_block(v, x + i, m);
    });
  }
}

// buf[i] = store(f(load(buf[i]), load(grad[i]))) for i < n.
template <typename B, typename G, typename F>
inline void map2_inplace(B* buf, const G* grad, int64_t n, F&& f) {
  if constexpr (!kBlocked<B> && !kBlocked<G>) {
    for (int64_t i = 0; i < n; ++i) buf[i] = Elem<B>::store(f(Elem<B>::load(buf[i]), Elem<G>::load(grad[i])));
  } else {
    for_blocks(n, [&](int64_t i, int64_t m) __attribute__((always_inline)) {
      float b[kBlock];
      float g[kBlock];
      load_block(buf + i, b, m);
      load_block(grad + i, g, m);
      for (int64_t j = 0; j < m; ++j) b[j] = f(b[j], g[j]);
      store_block(b, buf + i, m);
    });
  }
}

// Norm statistics in kLanes independent accumulators: lane l takes
// elements l, l + kLanes, ... The lane count, hence the summation order, is
// the same in every variant, so every variant gives the same bits; the lanes
// are held in the variant's own vector width (GCC's vector extension; wider
// generic vectors are split badly), 4 SSE, 2 AVX2 or 1 AVX-512 register.
constexpr int kLanes = 16;
#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#elif defined(__AVX__)
constexpr int kVecBytes = 32;
#else
constexpr int kVecBytes = 16;
#endif
constexpr int kVecLanes = kVecBytes / int(sizeof(float));
constexpr int kVecs = kLanes / kVecLanes;
using FloatVec = float __attribute__((vector_size(kVecBytes)));
using IntVec = int32_t __attribute__((vector_size(kVecBytes)));

template <typename T>
NormAcc reduce_norm(const T* __restrict x, int64_t n) {
  // norm_acc_add lane-wise: the sum of squares with two roundings per step
  // (-ffp-contract=off), max_abs_nan as an integer max of |x|'s bits (a
  // signed max is exact: the sign bit is cleared).
  FloatVec sumsq[kVecs] = {};
  IntVec maxbits[kVecs] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    float v[kLanes];
    load_block(x + i, v, kLanes);
    for (int k = 0; k < kVecs; ++k) {
      FloatVec f;
      std::memcpy(&f, v + k * kVecLanes, sizeof f);
      sumsq[k] = sumsq[k] + f * f;
      IntVec b;
      std::memcpy(&b, v + k * kVecLanes, sizeof b);
      b &= 0x7FFFFFFF;
      maxbits[k] = b > maxbits[k] ? b : maxbits[k];
    }
  }
  NormAcc total = norm_acc_init();
  for (; i < n; ++i) total = norm_acc_add(total, Elem<T>::load(x[i]));
  for (int l = 0; l < kLanes; ++l) {
    const int k = l / kVecLanes, j = l % kVecLanes;
    total = norm_acc_merge(total, NormAcc{sumsq[k][j], bits_float(uint32_t(maxbits[k][j]))});
  }
  return total;
}

// x *= factor in one pass; returns false when some input is Inf or NaN
// (checked on the input, as torch's unscale does): max |x|'s bits is then
// at least Inf's. The max is kept per vector lane across the loop, so no
// horizontal reduction sits in it.
//
// fp32 runs straight from memory in the variant's vectors: staging it
// through a block buffer, as the converted types must be, ran at 0.7-0.9x
// torch's kernel on this memory-bound pass.
inline bool unscale_chunk(float* x, int64_t n, float factor) {
  IntVec lanes = {};  // a signed max is exact: the sign bit is cleared
  int64_t i = 0;
  for (; i + kVecLanes <= n; i += kVecLanes) {
    FloatVec f;
    std::memcpy(&f, x + i, sizeof f);
    IntVec b;
    std::memcpy(&b, &f, sizeof b);
    b &= 0x7FFFFFFF;
    lanes = b > lanes ? b : lanes;
    f = f * factor;  // mul_rn: a lone multiply, which nothing contracts
    std::memcpy(x + i, &f, sizeof f);
  }
  if (i < n) {  // the tail as one zero-padded vector (zero bits leave the max alone): no scalar loop
    const size_t bytes = size_t(n - i) * sizeof(float);
    FloatVec f = {};
    std::memcpy(&f, x + i, bytes);
    IntVec b;
    std::memcpy(&b, &f, sizeof b);
    b &= 0x7FFFFFFF;
    lanes = b > lanes ? b : lanes;
    f = f * factor;
    std::memcpy(x + i, &f, bytes);
  }
  int32_t top = 0;
  for (int l = 0; l < kVecLanes; ++l) top = std::max(top, lanes[l]);
  return is_finite(bits_float(uint32_t(top)));
}

template <typename T>
bool unscale_chunk(T* x, int64_t n, float factor) {
  IntVec lanes = {};
  int32_t tail = 0;
  for_blocks(n, [&](int64_t i, int64_t m) __attribute__((always_inline)) {
    float v[kBlock];
    load_block(x + i, v, m);
    if (m == kBlock) {
      for (int64_t k = 0; k < kBlock; k += kVecLanes) {
        IntVec b;
        std::memcpy(&b, v + k, sizeof b);
        b &= 0x7FFFFFFF;
        lanes = b > lanes ? b : lanes;
      }
    } else {
      for (int64_t j = 0; j < m; ++j) tail = std::max(tail, int32_t(float_bits(v[j]) & 0x7FFFFFFFu));
    }
    for (int64_t j = 0; j < m; ++j) v[j] = mul_rn(v[j], factor);
    store_block(v, x + i, m);
  });
  for (int l = 0; l < kVecLanes; ++l) tail = std::max(tail, lanes[l]);
  return is_finite(bits_float(uint32_t(tail)));
}

}  // namespace gradacc::cpu::GRADACC_CPU_ISA
