// Runtime -> compile-time dispatch of the fused optimizer steps, shared by
// the CPU kernel and the CUDA kernel. Torch-free.
#pragma once

#include <type_traits>

#include "optim_params.h"

namespace gradacc {

template <typename P>
constexpr bool kIs16Bit = std::is_same_v<P, Half> || std::is_same_v<P, BFloat16>;

// The compute (and state) type of a param type: double for fp64, else float.
template <typename P>
using ComputeOf = std::conditional_t<std::is_same_v<P, double>, double, float>;

// Calls f(P{}, G{}) for a param dtype and its grad's dtype (P's own or fp32).
template <typename F>
GRADACC_HD void dispatch_param_grad(DType param, DType grad, F&& f) {
  auto with_grad = [&](auto tag) {
    using P = decltype(tag);
    if (grad == DType::kFloat32) {
      f(P{}, float{});
    } else {
      f(P{}, P{});
    }
  };
  switch (param) {
    case DType::kFloat64: with_grad(double{}); break;
    case DType::kFloat16: with_grad(Half{}); break;
    case DType::kBFloat16: with_grad(BFloat16{}); break;
    default: f(float{}, float{}); break;
  }
}

template <ParamMode M>
using ModeTag = std::integral_constant<ParamMode, M>;

// Calls f(ModeTag<M>{}) with the param mode as a compile-time constant;
// fp32/fp64 params always round to nearest (their stores are exact).
template <typename P, typename F>
GRADACC_HD void dispatch_mode(ParamMode mode, F&& f) {
  if constexpr (kIs16Bit<P>) {
    if (mode == ParamMode::kMaster) {
      f(ModeTag<ParamMode::kMaster>{});
      return;
    }
    if (mode == ParamMode::kStochastic) {
      f(ModeTag<ParamMode::kStochastic>{});
      return;
    }
  }
  f(ModeTag<ParamMode::kNearest>{});
}

// The new value of a 16-bit (or wider) param in mode M; `position` is the
// element's global position, which picks its random bits.
template <typename P, ParamMode M, typename C>
GRADACC_HD P store_param(C x, uint64_t stream, uint64_t position) {
  if constexpr (M == ParamMode::kStochastic) {
    return Stochastic<P>::store(float(x), uint32_t(splitmix64(stream + position) >> 32));
  } else {
    return store_as<P>(x);
  }
}

}  // namespace gradacc
