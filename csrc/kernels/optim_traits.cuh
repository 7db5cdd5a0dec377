// The fused optimizer ops, each described once: its schema, its state
// slots, its scalar options and their rules, and its element update. Every
// layer reads the traits and nothing else names an optimizer: ops.cpp
// defines the schemas and binding_optim.cpp reads and checks the arguments,
// both from ../optim_args.h, which places these names among the arguments
// every step takes (gradacc_ext/ops/optim_args.py holds the same rules), the CPU
// kernel (cpu/optim_cpu.cpp) and the CUDA kernel (optim_step.cuh) run
// update(). Torch-free; the element math runs on host and device.
//
// A traits struct T has:
//   kName                  the op's name; its schema follows from the names
//                          below (../optim_args.h; optim_args.py's schema_order)
//   kSlots, kState[], kStateOptional[]   state lists, in slot order
//   kStateSigned[]         which 8-bit code book an int8 slot uses (quant_maps.h):
//                          signed (momenta) or unsigned (second moments)
//   kNoInt8[]              per slot: why it may not be stored as int8 (the
//                          option it serves), or nullptr where it may
//   kOptions[], kWeightDecay, kBoolOptions   scalar options (schema order;
//                                        float, or bool where their bit is
//                                        set, read as 0/1), weight_decay's index
//   check_options(o, rules), steps_required(o, mode), check_state(o, has, n, rules)
//                                        the option rules (binding and Python alike)
//   kFlagBits, flags(o, has)             compile-time variants of one step
//   uses(slot, flags)                    whether a variant reads and writes a slot
//   Consts<C>, consts<C>(o, lr, done, grad_mult)   per-tensor constants (done:
//                                        steps taken before this one)
//   update<kFlags>(p, g, s, k)           one element: returns the new param,
//                                        updates the state values s[slot] in place
#pragma once

#include <cmath>
#include <cstring>
#include <type_traits>

#include "optim_math.cuh"

namespace gradacc {

constexpr int kMaxStateSlots = 3;
constexpr int kMaxOptions = 4;

// The scalar arguments of one step.
struct OptimScalars {
  double lr = 0.0;  // multiplied by the optional lr tensor
  bool maximize = false;
  double option[kMaxOptions] = {};  // the optimizer's kOptions, in order
};

// torch.optim's rule for betas (AdamW, Lion).
template <class Rules>
void check_betas(double beta1, double beta2, Rules& r) {
  r.invalid(beta1 >= 0.0 && beta1 < 1.0, "beta parameter at index 0", beta1);
  r.invalid(beta2 >= 0.0 && beta2 < 1.0, "beta parameter at index 1", beta2);
}

// ---- AdamW ---------------------------------------------------------------

struct AdamW {
  static constexpr const char* kName = "adamw_step_";
  static constexpr int kSlots = 3;
  static constexpr const char* kState[kSlots] = {"exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"};
  static constexpr bool kStateOptional[kSlots] = {false, false, true};  // amsgrad
  static constexpr bool kStateSigned[kSlots] = {true, false, false};
  // int8 with amsgrad is refused (LOWBIT_SPEC.md): amsgrad takes bf16 or fp32 states
  static constexpr const char* kNoInt8[kSlots] = {nullptr, nullptr, "amsgrad"};
  static constexpr const char* kOptions[] = {"beta1", "beta2", "eps", "weight_decay"};
  enum : int { kBeta1, kBeta2, kEps, kWeightDecay };
  static constexpr int kBoolOptions = 0;

  template <class Rules>
  static void check_options(const double* o, Rules& r) {
    r.invalid(std::isfinite(o[kEps]) && o[kEps] >= 0.0, "epsilon value", o[kEps]);
    check_betas(o[kBeta1], o[kBeta2], r);
  }
  static bool steps_required(const double*, int) { return true; }
  template <class Rules>
  static void check_state(const double*, const bool*, size_t, Rules&) {}

  static constexpr int kFlagBits = 1;
  static int flags(const double*, const bool* has) { return has[2] ? 1 : 0; }
  GRADACC_HD static constexpr bool uses(int slot, int flags) { return slot < 2 || (flags & 1) != 0; }

  // Computed in double from the step count (as torch's fused CPU kernel does), then rounded to C.
  template <typename C>
  struct Consts {
    C decay;  // 1 - lr * weight_decay (decoupled weight decay)
    C beta2, one_minus_beta1, one_minus_beta2;
    C step_size;  // lr / (1 - beta1^step)
    C bc2_sqrt;   // sqrt(1 - beta2^step)
    C eps;
    C grad_mult;  // negated for maximize
  };
  template <typename C>
  GRADACC_HD static Consts<C> consts(const OptimScalars& s, double lr, double done, double grad_mult) {
    const double* o = s.option;
    const double step = done + 1.0;
    return Consts<C>{C(1.0 - lr * o[kWeightDecay]),
                     C(o[kBeta2]),
                     C(1.0 - o[kBeta1]),
                     C(1.0 - o[kBeta2]),
                     C(lr / (1.0 - pow(o[kBeta1], step))),
                     C(sqrt(1.0 - pow(o[kBeta2], step))),
                     C(o[kEps]),
                     C(s.maximize ? -grad_mult : grad_mult)};
  }

  // s: exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad only).
  template <int kFlags, typename C, typename S>
  GRADACC_STEP_HD static C update(C p, C g, S&& s, const Consts<C>& k) {
    g = mul_rn(g, k.grad_mult);
    p = mul_rn(p, k.decay);
    s[0] = lerp(s[0], g, k.one_minus_beta1);
    s[1] = add_rn(mul_rn(s[1], k.beta2), mul_rn(mul_rn(g, g), k.one_minus_beta2));
    C second = s[1];
    if constexpr ((kFlags & 1) != 0) {
      s[2] = maximum_nan(s[2], s[1]);
      second = s[2];
    }
    const C denom = add_rn(div_rn(sqrt_rn(second), k.bc2_sqrt), k.eps);
    return add_rn(p, -mul_rn(k.step_size, div_rn(s[0], denom)));
  }
};

// ---- SGD -----------------------------------------------------------------

struct Sgd {
  static constexpr const char* kName = "sgd_step_";
  static constexpr int kSlots = 1;
  static constexpr const char* kState[kSlots] = {"momentum_buffers"};
  static constexpr bool kStateOptional[kSlots] = {true};  // momentum only
  static constexpr bool kStateSigned[kSlots] = {true};
  static constexpr const char* kNoInt8[kSlots] = {nullptr};
  static constexpr const char* kOptions[] = {"momentum", "dampening", "weight_decay", "nesterov"};
  enum : int { kMomentum, kDampening, kWeightDecay, kNesterov };
  static constexpr int kBoolOptions = 1 << kNesterov;

  template <class Rules>
  static void check_options(const double* o, Rules& r) {
    r.invalid(std::isfinite(o[kMomentum]) && o[kMomentum] >= 0.0, "momentum value", o[kMomentum]);
    r.invalid(std::isfinite(o[kDampening]), "dampening value", o[kDampening]);
    r.require(o[kNesterov] == 0.0 || (o[kMomentum] > 0.0 && o[kDampening] == 0.0),
              "Nesterov momentum requires a momentum and zero dampening");
  }
  // The first step is told by its count: momentum needs one, and stochastic
  // rounding draws a fresh stream per step.
  static bool steps_required(const double* o, int mode) { return o[kMomentum] != 0.0 || mode == 2; }
  template <class Rules>
  static void check_state(const double* o, const bool* has, size_t num_params, Rules& r) {
    r.require(o[kMomentum] == 0.0 || has[0] || num_params == 0, "momentum_buffers must be given when momentum != 0");
  }

  // Bits: 4 momentum (buffers given and momentum != 0), 2 nesterov, 1 weight decay.
  static constexpr int kFlagBits = 3;
  static int flags(const double* o, const bool* has) {
    return (has[0] && o[kMomentum] != 0.0 ? 4 : 0) | (o[kNesterov] != 0.0 ? 2 : 0) | (o[kWeightDecay] != 0.0 ? 1 : 0);
  }
  GRADACC_HD static constexpr bool uses(int, int flags) { return (flags & 4) != 0; }

  template <typename C>
  struct Consts {
    C neg_lr;
    C weight_decay;
    C momentum;
    C one_minus_dampening;
    C grad_mult;  // negated for maximize
    bool first;   // the momentum buffer starts as the first step's gradient
  };
  template <typename C>
  GRADACC_HD static Consts<C> consts(const OptimScalars& s, double lr, double done, double grad_mult) {
    const double* o = s.option;
    return Consts<C>{C(-lr), C(o[kWeightDecay]), C(o[kMomentum]), C(1.0 - o[kDampening]),
                     C(s.maximize ? -grad_mult : grad_mult), done == 0.0};
  }

  // s: the momentum buffer (momentum only).
  template <int kFlags, typename C, typename S>
  GRADACC_STEP_HD static C update(C p, C g, S&& s, const Consts<C>& k) {
    g = mul_rn(g, k.grad_mult);
    if constexpr ((kFlags & 1) != 0) g = add_rn(g, mul_rn(k.weight_decay, p));
    if constexpr ((kFlags & 4) != 0) {
      s[0] = k.first ? g : add_rn(mul_rn(s[0], k.momentum), mul_rn(g, k.one_minus_dampening));
      g = (kFlags & 2) != 0 ? add_rn(g, mul_rn(k.momentum, s[0])) : s[0];
    }
    return add_rn(p, mul_rn(k.neg_lr, g));
  }
};

// ---- Lion ----------------------------------------------------------------

// Lion (Chen et al. 2023) as lion-pytorch updates: decay, the sign of the
// interpolated momentum, then the momentum.
struct Lion {
  static constexpr const char* kName = "lion_step_";
  static constexpr int kSlots = 1;
  static constexpr const char* kState[kSlots] = {"exp_avgs"};
  static constexpr bool kStateOptional[kSlots] = {false};
  static constexpr bool kStateSigned[kSlots] = {true};
  static constexpr const char* kNoInt8[kSlots] = {nullptr};
  static constexpr const char* kOptions[] = {"beta1", "beta2", "weight_decay"};
  enum : int { kBeta1, kBeta2, kWeightDecay };
  static constexpr int kBoolOptions = 0;

  template <class Rules>
  static void check_options(const double* o, Rules& r) {
    check_betas(o[kBeta1], o[kBeta2], r);
  }
  static bool steps_required(const double*, int mode) { return mode == 2; }  // stochastic rounding's stream
  template <class Rules>
  static void check_state(const double*, const bool*, size_t, Rules&) {}

  static constexpr int kFlagBits = 0;
  static int flags(const double*, const bool*) { return 0; }
  GRADACC_HD static constexpr bool uses(int, int) { return true; }

  template <typename C>
  struct Consts {
    C decay;  // 1 - lr * weight_decay
    C lr;
    C beta1, one_minus_beta1, beta2, one_minus_beta2;
    C grad_mult;  // negated for maximize
  };
  template <typename C>
  GRADACC_HD static Consts<C> consts(const OptimScalars& s, double lr, double, double grad_mult) {
    const double* o = s.option;
    return Consts<C>{C(1.0 - lr * o[kWeightDecay]), C(lr),
                     C(o[kBeta1]),                  C(1.0 - o[kBeta1]),
                     C(o[kBeta2]),                  C(1.0 - o[kBeta2]),
                     C(s.maximize ? -grad_mult : grad_mult)};
  }

  // s: exp_avg. torch.sign: +-1, zero stays zero, NaN stays NaN.
  template <int kFlags, typename C, typename S>
  GRADACC_STEP_HD static C update(C p, C g, S&& s, const Consts<C>& k) {
    g = mul_rn(g, k.grad_mult);
    p = mul_rn(p, k.decay);
    const C c = add_rn(mul_rn(s[0], k.beta1), mul_rn(g, k.one_minus_beta1));
    const C direction = c > C(0) ? C(1) : (c < C(0) ? C(-1) : c);
    s[0] = add_rn(mul_rn(s[0], k.beta2), mul_rn(g, k.one_minus_beta2));
    return add_rn(p, -mul_rn(k.lr, direction));
  }
};

// ---- the list ------------------------------------------------------------

template <typename... T>
struct OptimList {
  static constexpr int kCount = int(sizeof...(T));
};
using Optimizers = OptimList<AdamW, Sgd, Lion>;

// An optimizer's index in Optimizers (OptimParams::kind).
template <typename T, typename... Ts>
constexpr int kind_index(OptimList<Ts...>) {
  int i = 0, found = -1;
  ((std::is_same_v<T, Ts> ? (found = i, ++i) : ++i), ...);
  return found;
}
template <typename T>
constexpr int kKindOf = kind_index<T>(Optimizers{});

// Calls f(T{}) for the optimizer of index `kind`.
template <typename F, typename... Ts>
GRADACC_HD void dispatch_optim_in(int kind, F&& f, OptimList<Ts...>) {
  int i = 0;
  ((i++ == kind ? (f(Ts{}), 0) : 0), ...);
}
template <typename F>
GRADACC_HD void dispatch_optim(int kind, F&& f) {
  dispatch_optim_in(kind, f, Optimizers{});
}

// Calls f(T{}) for every optimizer.
template <typename F, typename... Ts>
void for_each_optim_in(F&& f, OptimList<Ts...>) {
  (f(Ts{}), ...);
}
template <typename F>
void for_each_optimizer(F&& f) {
  for_each_optim_in(f, Optimizers{});
}

// The index of the optimizer named `name`, or -1.
inline int optim_kind(const char* name) {
  int kind = -1;
  for_each_optimizer([&](auto t) {
    if (std::strcmp(decltype(t)::kName, name) == 0) kind = kKindOf<decltype(t)>;
  });
  return kind;
}

// Calls f(std::integral_constant<int, F>{}) for runtime flags in [0, N).
template <typename Fn, int... F>
GRADACC_HD void dispatch_flags_in(int flags, Fn&& f, std::integer_sequence<int, F...>) {
  ((flags == F ? (f(std::integral_constant<int, F>{}), 0) : 0), ...);
}
template <int N, typename Fn>
GRADACC_HD void dispatch_flags(int flags, Fn&& f) {
  dispatch_flags_in(flags, f, std::make_integer_sequence<int, N>{});
}

}  // namespace gradacc
