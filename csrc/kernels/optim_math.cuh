// Per-element AdamW and SGD math of the fused optimizer steps, shared by the
// CPU kernels (g++) and the CUDA kernels (nvcc). Torch-free.
//
// The compute type C is float, or double for fp64 params (their state is
// fp64 too). The formulas follow torch.optim.AdamW / SGD operation by
// operation (lerp for exp_avg, addcmul for exp_avg_sq, addcdiv for the
// update), every operation rounded on its own (no FMA contraction, see
// element_math.cuh), so fp32 results stay within a few ulps of torch's.
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

// ---- AdamW ---------------------------------------------------------------

// The scalar options of a step, as the op received them.
struct OptimScalars {
  double lr = 0.0;  // multiplied by the optional lr tensor
  double weight_decay = 0.0;
  bool maximize = false;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // AdamW
  double momentum = 0.0, dampening = 0.0;          // SGD
  bool nesterov = false;
};

// The per-tensor constants of one AdamW step, computed in double from the
// step count (as torch's fused CPU kernel does) and then rounded to C.
template <typename C>
struct AdamConsts {
  C decay;  // 1 - lr * weight_decay (decoupled weight decay)
  C beta2, one_minus_beta1, one_minus_beta2;
  C step_size;  // lr / (1 - beta1^step)
  C bc2_sqrt;   // sqrt(1 - beta2^step)
  C eps;
  C grad_mult;  // grad multiplier, negated for maximize
};

// `lr` is the effective rate; `step` counts this step (1 on the first).
template <typename C>
GRADACC_HD AdamConsts<C> adam_consts(const OptimScalars& s, double lr, double step, double grad_mult) {
  AdamConsts<C> k;
  k.decay = C(1.0 - lr * s.weight_decay);
  k.beta2 = C(s.beta2);
  k.one_minus_beta1 = C(1.0 - s.beta1);
  k.one_minus_beta2 = C(1.0 - s.beta2);
  k.step_size = C(lr / (1.0 - pow(s.beta1, step)));
  k.bc2_sqrt = C(sqrt(1.0 - pow(s.beta2, step)));
  k.eps = C(s.eps);
  k.grad_mult = C(s.maximize ? -grad_mult : grad_mult);
  return k;
}

// One element of AdamW; returns the new param. m, v (and vmax with kAmsgrad)
// are updated in place.
template <bool kAmsgrad, typename C>
GRADACC_STEP_HD C adamw_value(C p, C g, C& m, C& v, C& vmax, const AdamConsts<C>& k) {
  g = mul_rn(g, k.grad_mult);
  p = mul_rn(p, k.decay);
  m = lerp(m, g, k.one_minus_beta1);
  v = add_rn(mul_rn(v, k.beta2), mul_rn(mul_rn(g, g), k.one_minus_beta2));
  C second = v;
  if constexpr (kAmsgrad) {
    vmax = maximum_nan(vmax, v);
    second = vmax;
  }
  const C denom = add_rn(div_rn(sqrt_rn(second), k.bc2_sqrt), k.eps);
  return add_rn(p, -mul_rn(k.step_size, div_rn(m, denom)));
}

// ---- SGD -----------------------------------------------------------------

template <typename C>
struct SgdConsts {
  C neg_lr;
  C weight_decay;
  C momentum;
  C one_minus_dampening;
  C grad_mult;  // negated for maximize
  bool first;   // the momentum buffer starts as the first step's gradient
};

// `steps_done` counts the steps taken before this one (0 on the first).
template <typename C>
GRADACC_HD SgdConsts<C> sgd_consts(const OptimScalars& s, double lr, double steps_done, double grad_mult) {
  return SgdConsts<C>{C(-lr), C(s.weight_decay), C(s.momentum), C(1.0 - s.dampening),
                      C(s.maximize ? -grad_mult : grad_mult), steps_done == 0.0};
}

// One element of SGD; returns the new param; buf is the momentum buffer
// (used only with kMomentum).
template <bool kMomentum, bool kNesterov, bool kDecay, typename C>
GRADACC_STEP_HD C sgd_value(C p, C g, C& buf, const SgdConsts<C>& k) {
  g = mul_rn(g, k.grad_mult);
  if constexpr (kDecay) g = add_rn(g, mul_rn(k.weight_decay, p));
  if constexpr (kMomentum) {
    buf = k.first ? g : add_rn(mul_rn(buf, k.momentum), mul_rn(g, k.one_minus_dampening));
    g = kNesterov ? add_rn(g, mul_rn(k.momentum, buf)) : buf;
  }
  return add_rn(p, mul_rn(k.neg_lr, g));
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
