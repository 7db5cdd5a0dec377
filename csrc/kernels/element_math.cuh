// Element math shared by the CPU kernels (g++) and the CUDA kernels (nvcc).
//
// Torch-free on purpose: the same functions run on host and device, so the
// CPU tests exercise exactly the arithmetic the GPU performs. Every float
// operation goes through mul_rn/add_rn so neither compiler may contract a
// multiply-add into an FMA; that keeps CPU and GPU results bit-identical.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#define GRADACC_HD __host__ __device__ __forceinline__
#else
#define GRADACC_HD inline
#endif

namespace gradacc {

// Element types the kernels understand. The 16-bit types are plain bit
// containers so that device code needs neither torch nor cuda_fp16.h.
// kFloat64: list elements of the norm and clip ops and of the fused optimizer
// steps (optim_math.cuh), and a clip's total_norm. kUInt8: the codes of the
// optimizer steps' int8 state (quant_math.cuh), never an element of a float list.
enum class DType : int8_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3, kUInt8 = 4 };

struct Half { uint16_t bits; };
struct BFloat16 { uint16_t bits; };

// The vector norms of torch.linalg.vector_norm. kL2 and kInf share the fast
// path (sum of squares and max |x| in one pass); 0, 1 and -inf are exact
// special cases; kP is any other p, through pow_d.
enum class NormKind : int8_t { kL2 = 0, kInf = 1, kNegInf = 2, kZero = 3, kOne = 4, kP = 5 };

GRADACC_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

GRADACC_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// Round-to-nearest-even multiply, add, divide and square root that no compiler may fuse.
// nvcc contracts a*b+c into an FMA unless told not to: the _rn intrinsics
// forbid it. The host side is built with -ffp-contract=off (setup.py).
GRADACC_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

GRADACC_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

GRADACC_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;  // an add alone cannot be contracted
#endif
}

GRADACC_HD float sqrt_rn(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}

// The same in double: fp64 lists (norms, clips) and the fp64 optimizer steps.
GRADACC_HD double mul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

GRADACC_HD double div_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}

GRADACC_HD double add_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

GRADACC_HD double sqrt_rn(double x) {
#if defined(__CUDA_ARCH__)
  return __dsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}

GRADACC_HD bool is_finite(float x) {
  // Exponent all ones means Inf or NaN; one integer test, no libm call.
  return (float_bits(x) & 0x7F800000u) != 0x7F800000u;
}

GRADACC_HD bool is_nan(float x) { return (float_bits(x) & 0x7FFFFFFFu) > 0x7F800000u; }

// max of two non-negative values (|x|, or a NaN with its sign bit cleared)
// that propagates NaN: for such values the bit patterns order like the
// numbers, and every NaN pattern is above +Inf's. fmaxf would drop the NaN
// and hide it from the inf-norm and the found-inf logic built on it. An
// integer max also vectorises on the CPU, where a float compare-and-branch
// does not.
GRADACC_HD float max_abs_nan(float a, float b) { return float_bits(a) > float_bits(b) ? a : b; }

GRADACC_HD float abs_f(float x) { return bits_float(float_bits(x) & 0x7FFFFFFFu); }

// ---- 16-bit conversions, IEEE round-to-nearest-even, branch-free --------

GRADACC_HD float bf16_to_float(BFloat16 h) { return bits_float(uint32_t(h.bits) << 16); }

GRADACC_HD BFloat16 float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if (is_nan(f)) return BFloat16{uint16_t((u >> 16) | 0x0040u)};  // keep it a quiet NaN
  const uint32_t rounding_bias = 0x7FFFu + ((u >> 16) & 1u);
  return BFloat16{uint16_t((u + rounding_bias) >> 16)};
}

// Half -> float: rebias the exponent with one multiply for normals, and
// build subnormals with a magic-number subtraction; both are exact.
GRADACC_HD float half_to_float(Half h) {
  const uint32_t w = uint32_t(h.bits) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = mul_rn(bits_float((two_w >> 4) + (0xE0u << 23)), bits_float(0x7800000u));  // 2^-112
  const float denormalized = add_rn(bits_float((two_w >> 17) | (126u << 23)), -0.5f);
  const uint32_t result = sign | (two_w < (1u << 27) ? float_bits(denormalized) : float_bits(normalized));
  return bits_float(result);
}

// Float -> half: scaling by 2^112 then 2^-110 performs the rounding in fp32
// hardware at the right bit position; overflow saturates to Inf by itself.
GRADACC_HD Half float_to_half(float f) {
  const float scale_to_inf = bits_float(0x77800000u);   // 2^112
  const float scale_to_zero = bits_float(0x08800000u);  // 2^-110
  float base = mul_rn(mul_rn(abs_f(f), scale_to_inf), scale_to_zero);
  const uint32_t w = float_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = add_rn(bits_float((bias >> 1) + 0x07800000u), base);
  const uint32_t bits = float_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return Half{uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign))};
}

template <typename T> struct Elem;
template <> struct Elem<float> {
  GRADACC_HD static float load(float x) { return x; }
  GRADACC_HD static float store(float x) { return x; }
};
template <> struct Elem<Half> {
  GRADACC_HD static float load(Half x) { return half_to_float(x); }
  GRADACC_HD static Half store(float x) { return float_to_half(x); }
};
template <> struct Elem<BFloat16> {
  GRADACC_HD static float load(BFloat16 x) { return bf16_to_float(x); }
  GRADACC_HD static BFloat16 store(float x) { return float_to_bf16(x); }
};

// ---- The per-element operations of every op -----------------------------

// bufs[i] = (assign ? 0 : bufs[i]) + alpha * grads[i]
GRADACC_HD float accumulate_value(float buf, float grad, float alpha, bool assign) {
  const float scaled = mul_rn(alpha, grad);
  return assign ? scaled : add_rn(buf, scaled);
}

// torch.clamp(x, -v, v): max with -v, then min with v, so a negative v (an
// empty range) gives v everywhere, as torch does; NaN stays NaN. float or double.
template <typename A>
GRADACC_HD A clip_value(A x, A v) {
  const A lo = x < -v ? -v : x;
  return lo > v ? v : lo;
}

GRADACC_HD uint64_t double_bits(double d) {
#if defined(__CUDA_ARCH__)
  return uint64_t(__double_as_longlong(d));
#else
  uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
#endif
}

GRADACC_HD double bits_double(uint64_t u) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double((long long)u);
#else
  double d;
  std::memcpy(&d, &u, sizeof d);
  return d;
#endif
}

// a^b for a >= 0 as exp(b * log(a)) in double: within ~|b log a| * 2^-53 of
// the exact power (far below a float's rounding, ~1e-14 relative in double),
// and light enough for the device kernels (::pow's double-double path spills
// registers there). log(0) = -inf gives 0 or inf, as the power does.
GRADACC_HD double pow_d(double a, double b) { return ::exp(b * ::log(a)); }

// The arithmetic of a norm accumulator or clip in A = float (fp32/fp16/bf16
// data) or double (float64 data): round-to-nearest and never contracted, on
// host and device, like mul_rn/add_rn. Absolute values order like their bit
// patterns, and every NaN pattern is above +Inf's (see max_abs_nan).
template <typename A> struct Arith;

template <> struct Arith<float> {
  GRADACC_HD static float add(float a, float b) { return add_rn(a, b); }
  GRADACC_HD static float mul(float a, float b) { return mul_rn(a, b); }
  GRADACC_HD static float div(float a, float b) { return div_rn(a, b); }
  GRADACC_HD static float sqrt(float a) { return sqrt_rn(a); }
  GRADACC_HD static float abs(float x) { return abs_f(x); }
  GRADACC_HD static bool isnan(float x) { return is_nan(x); }
  GRADACC_HD static float inf() { return bits_float(0x7F800000u); }
  GRADACC_HD static float max_abs(float a, float b) { return max_abs_nan(a, b); }
  GRADACC_HD static float min_abs(float a, float b) {
    if (is_nan(a) || is_nan(b)) return bits_float(0x7FC00000u);
    return float_bits(a) < float_bits(b) ? a : b;
  }
};

template <> struct Arith<double> {
  GRADACC_HD static double add(double a, double b) { return add_rn(a, b); }
  GRADACC_HD static double mul(double a, double b) { return mul_rn(a, b); }
  GRADACC_HD static double div(double a, double b) { return div_rn(a, b); }
  GRADACC_HD static double sqrt(double a) { return sqrt_rn(a); }
  GRADACC_HD static double abs(double x) { return bits_double(double_bits(x) & 0x7FFFFFFFFFFFFFFFull); }
  GRADACC_HD static bool isnan(double x) { return (double_bits(x) & 0x7FFFFFFFFFFFFFFFull) > 0x7FF0000000000000ull; }
  GRADACC_HD static double inf() { return bits_double(0x7FF0000000000000ull); }
  GRADACC_HD static double max_abs(double a, double b) { return double_bits(a) > double_bits(b) ? a : b; }
  GRADACC_HD static double min_abs(double a, double b) {
    if (isnan(a) || isnan(b)) return bits_double(0x7FF8000000000000ull);
    return double_bits(a) < double_bits(b) ? a : b;
  }
};

// min(1, max_norm / (norm + eps)); a NaN norm gives NaN, as torch's clamp does.
template <typename A>
GRADACC_HD A clip_coefficient(A norm, A max_norm, A eps) {
  const A coef = Arith<A>::div(max_norm, Arith<A>::add(norm, eps));
  return (coef < A(1) || Arith<A>::isnan(coef)) ? coef : A(1);
}

// Running statistics for the global norm, in A = float, or double when the
// list holds float64 data. For kL2/kInf: sum of squares and max |x|. For the
// other kinds `sumsq` is the sum of the p-norm's terms (norm_term) and
// `maxabs` is the extreme |x| the kind needs: the minimum for kNegInf (whose
// sum counts the elements, so an empty input gives 0).
template <typename A>
struct NormAccT {
  A sumsq;
  A maxabs;
};
using NormAcc = NormAccT<float>;

template <typename A = float>
GRADACC_HD NormAccT<A> norm_acc_init(NormKind kind = NormKind::kL2) {
  return NormAccT<A>{A(0), kind == NormKind::kNegInf ? Arith<A>::inf() : A(0)};
}

// The fp32 L2 / inf fast path: both statistics at once.
GRADACC_HD NormAcc norm_acc_add(NormAcc a, float x) {
  return NormAcc{add_rn(a.sumsq, mul_rn(x, x)), max_abs_nan(a.maxabs, abs_f(x))};
}

// What element x adds to the sum of a kind. kZero counts x != 0 (a NaN
// counts, as in torch); kP computes |x|^p in double (pow_d) and rounds once.
template <typename A>
GRADACC_HD A norm_term(A x, NormKind kind, double p) {
  switch (kind) {
    case NormKind::kZero: return x != A(0) ? A(1) : A(0);
    case NormKind::kOne: return Arith<A>::abs(x);
    case NormKind::kNegInf: return A(1);
    case NormKind::kP: return A(pow_d(double(Arith<A>::abs(x)), p));
    default: return Arith<A>::mul(x, x);
  }
}

// Any kind; for fp32, kL2 and kInf give exactly what norm_acc_add gives.
template <typename A>
GRADACC_HD NormAccT<A> norm_acc_add(NormAccT<A> a, A x, NormKind kind, double p) {
  const A ax = Arith<A>::abs(x);
  const A ext = kind == NormKind::kNegInf ? Arith<A>::min_abs(a.maxabs, ax) : Arith<A>::max_abs(a.maxabs, ax);
  return NormAccT<A>{Arith<A>::add(a.sumsq, norm_term(x, kind, p)), ext};
}

template <typename A>
GRADACC_HD NormAccT<A> norm_acc_merge(NormAccT<A> a, NormAccT<A> b, NormKind kind = NormKind::kL2) {
  const A ext =
      kind == NormKind::kNegInf ? Arith<A>::min_abs(a.maxabs, b.maxabs) : Arith<A>::max_abs(a.maxabs, b.maxabs);
  return NormAccT<A>{Arith<A>::add(a.sumsq, b.sumsq), ext};
}

template <typename A>
GRADACC_HD A norm_acc_result(NormAccT<A> a, NormKind kind, double p = 2.0) {
  switch (kind) {
    case NormKind::kInf: return a.maxabs;
    case NormKind::kNegInf: return a.sumsq == A(0) ? A(0) : a.maxabs;
    case NormKind::kZero:
    case NormKind::kOne: return a.sumsq;
    case NormKind::kP: return A(pow_d(double(a.sumsq), 1.0 / p));
    default: return Arith<A>::sqrt(a.sumsq);
  }
}

// The accumulate final step's running partial (kL2 or kInf), with one call's statistics added: the sum of
// squares, or the max |x| (NaN-propagating; the partial is >= 0 or NaN). Buckets add in fold order.
GRADACC_HD float norm_partial_add(float partial, NormAcc a, NormKind kind) {
  return kind == NormKind::kInf ? max_abs_nan(partial, a.maxabs) : add_rn(partial, a.sumsq);
}

// An element of any list dtype as accumulator type A. A float64 element
// only ever meets A = double (the binding widens a list that holds one).
template <typename A, typename T>
GRADACC_HD A load_as(T x) {
  if constexpr (std::is_same_v<T, double>) {
    return A(x);
  } else {
    return A(Elem<T>::load(x));
  }
}

// A one-element scalar of any float dtype (a clip's total_norm), as A.
template <typename A>
GRADACC_HD A load_scalar(const void* ptr, DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return A(half_to_float(*static_cast<const Half*>(ptr)));
    case DType::kBFloat16: return A(bf16_to_float(*static_cast<const BFloat16*>(ptr)));
    case DType::kFloat64: return A(*static_cast<const double*>(ptr));
    default: return A(*static_cast<const float*>(ptr));
  }
}

}  // namespace gradacc
