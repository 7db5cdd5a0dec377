// Loads and stores of the fused optimizer kernel (optim_step.cuh), in the compute type C: the param
// side (param or master, grad) and the per-element state storages (fp32, bf16). The int8 state is
// optim_quant.cuh's. Torch-free; the host emulation (tests/emulation) compiles it with g++.
#pragma once

#include <type_traits>

#include "multi_tensor.cuh"
#include "optim_dispatch.cuh"
#include "quant_math.cuh"

namespace gradacc::cuda {

// The param side of one chunk: grads and param values in, new param values out. Group loads and
// stores take W elements from offset i: W == 1, or a vector group (every pointer 16-byte aligned).
template <typename P, typename G, typename C, ParamMode M>
struct ParamLists {
  P* param;
  const G* grad;
  float* master;      // kMaster: the fp32 copy the step updates (C is float then)
  uint64_t stream;    // the step's random stream (rounding_stream): stochastic params and bf16 states
  uint64_t position;  // global position of the chunk's first element

  template <int W>
  __device__ __forceinline__ void load(int i, C (&p)[W], C (&g)[W]) const {
    G raw_g[W];
    load_raw<W>(grad + i, raw_g);
#pragma unroll
    for (int k = 0; k < W; ++k) g[k] = load_as<C>(raw_g[k]);
    if constexpr (M == ParamMode::kMaster) {
      load_raw<W>(master + i, p);
    } else {
      P raw[W];
      load_raw<W>(param + i, raw);
#pragma unroll
      for (int k = 0; k < W; ++k) p[k] = load_as<C>(raw[k]);
    }
  }

  template <int W>
  __device__ __forceinline__ void store(int i, const C (&p)[W]) const {
    P out[W];
#pragma unroll
    for (int k = 0; k < W; ++k) out[k] = store_param<P, M>(p[k], stream, position + uint64_t(i + k));
    if constexpr (M == ParamMode::kMaster) store_raw<W>(master + i, p);
    store_raw<W>(param + i, out);
  }
};

// Element k's state values of a group: s[slot] is st[slot][k] (the traits' update takes it).
template <typename C, int kSlots, int W>
struct Column {
  C (&st)[kSlots][W];
  int k;
  __device__ __forceinline__ C& operator[](int slot) const { return st[slot][k]; }
};

// The element type of a per-element state storage: the compute type itself (kFloat) or bf16.
template <StateStorage S, typename C>
using StateElem = std::conditional_t<S == StateStorage::kBFloat16, BFloat16, C>;

// W state values of a kFloat or kBFloat16 slot from p (bf16 widens exactly).
template <StateStorage S, int W, typename C>
__device__ __forceinline__ void load_state(const StateElem<S, C>* p, C (&x)[W]) {
  if constexpr (S == StateStorage::kFloat) {
    load_raw<W>(p, x);
  } else {
    BFloat16 raw[W];
    load_raw<W>(p, raw);
#pragma unroll
    for (int k = 0; k < W; ++k) x[k] = load_as<C>(raw[k]);
  }
}

// Stores W new state values of `slot` at p, the first at global `position`: exactly (kFloat), or
// with stochastic rounding from the slot's own random bits (kBFloat16, LOWBIT_SPEC.md section 3).
template <StateStorage S, int W, typename C>
__device__ __forceinline__ void store_state(StateElem<S, C>* p, const C (&x)[W], int slot, uint64_t stream,
                                            uint64_t position) {
  if constexpr (S == StateStorage::kFloat) {
    store_raw<W>(p, x);
  } else {
    BFloat16 raw[W];
#pragma unroll
    for (int k = 0; k < W; ++k) raw[k] = stochastic_bf16(x[k], state_random_bits(stream, position + uint64_t(k), slot));
    store_raw<W>(p, raw);
  }
}

}  // namespace gradacc::cuda
