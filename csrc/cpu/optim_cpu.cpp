// CPU kernels of the fused optimizer steps: one parallel pass over params,
// grads and state, chunked like every other op (csrc/kernels/chunking.h).
// The element math is each optimizer's update (csrc/kernels/optim_traits.cuh),
// shared with CUDA; nothing here names an optimizer. The state storage (fp32,
// bf16 with stochastic rounding, int8 blocks: quant_math.cuh) is a compile-time
// parameter, dispatched once per chunk.
// Compiled once per ISA into namespace GRADACC_CPU_ISA (isa.h, setup.py).
#include "optim_cpu.h"

#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <type_traits>

#include "../kernels/chunking.h"
#include "../kernels/optim_dispatch.cuh"
#include "../kernels/quant_math.cuh"

namespace gradacc::cpu::GRADACC_CPU_ISA {
namespace {

// Where one chunk's param value comes from and how its new value is stored.
template <typename P, typename C, ParamMode M>
struct ParamIO {
  P* param;
  float* master;        // kMaster
  uint64_t stream;      // kStochastic: the step's random stream (rounding_stream)
  uint64_t position;    // kStochastic: global position of the chunk's first element

  C load(int64_t i) const {
    if constexpr (M == ParamMode::kMaster) return C(master[i]);
    else return load_as<C>(param[i]);
  }
  void store(int64_t i, C x) const {
    if constexpr (M == ParamMode::kMaster) master[i] = float(x);
    param[i] = store_param<P, M>(x, stream, position + uint64_t(i));
  }
};

template <typename E> E* state_ptr(const std::vector<Span>& list, size_t t, int64_t first) {
  return list.empty() ? nullptr : static_cast<E*>(list[t].data) + first;
}

// A state element of storage S in compute type C: fp32/fp64 exactly, bf16 loaded exactly and stored with
// stochastic rounding (the slot's own draw at the element's position), uint8 codes (int8, step_blocks).
template <StateStorage S, typename C>
using StateElem = std::conditional_t<S == StateStorage::kFloat, C,
                                     std::conditional_t<S == StateStorage::kBFloat16, BFloat16, uint8_t>>;

// Where a chunk's random bits come from: the step's stream and the chunk's first position (as the params').
struct Draws {
  uint64_t stream;
  uint64_t position;
};

// One chunk of optimizer T in variant kFlags, fp32 or bf16 storage; state[s] is null for a slot the variant
// does not use.
// `io` and `k` arrive by value: locals whose address never escapes, so the compiler keeps them in
// registers and knows that the loop's stores leave them unchanged (it vectorises the loop without a
// runtime alias check against them; by reference, through a dispatch level that is not inlined, it did not).
template <typename T, int kFlags, StateStorage S, typename IO, typename G, typename C>
void step_chunk(const IO io, const G* grad, StateElem<S, C>* const* state, int64_t n,
                const typename T::template Consts<C> k, Draws draws) {
  StateElem<S, C>* st[T::kSlots];  // local copies, so the loop provably keeps them
  for (int slot = 0; slot < T::kSlots; ++slot) st[slot] = state[slot];
  for (int64_t i = 0; i < n; ++i) {
    C s[T::kSlots];
    for (int slot = 0; slot < T::kSlots; ++slot) s[slot] = T::uses(slot, kFlags) ? load_as<C>(st[slot][i]) : C(0);
    io.store(i, T::template update<kFlags>(io.load(i), load_as<C>(grad[i]), s, k));
    for (int slot = 0; slot < T::kSlots; ++slot) {
      if (!T::uses(slot, kFlags)) continue;
      if constexpr (S == StateStorage::kBFloat16) {
        st[slot][i] = stochastic_bf16(s[slot], state_random_bits(draws.stream, draws.position + uint64_t(i), slot));
      } else {
        st[slot][i] = s[slot];
      }
    }
  }
}

// One chunk of optimizer T in variant kFlags, int8 storage: per block of kQuantBlock elements (a chunk starts
// on a block boundary), decode each used slot with its block's old absmax, update, then requantize with the
// block's new absmax (LOWBIT_SPEC.md section 3). scales[s] points at the chunk's first block's absmax.
template <typename T, int kFlags, typename IO, typename G>
void step_blocks(const IO& io, const G* grad, uint8_t* const* codes, float* const* scales, int64_t n,
                 const typename T::template Consts<float>& k) {
  const float* book[T::kSlots];
  const uint8_t* first_code[T::kSlots];
  const float* mids[T::kSlots];
  for (int slot = 0; slot < T::kSlots; ++slot) {
    book[slot] = quant_codes(T::kStateSigned[slot]);
    first_code[slot] = quant_encode_first(T::kStateSigned[slot]);
    mids[slot] = quant_encode_midpoints(T::kStateSigned[slot]);
  }
  for (int64_t first = 0; first < n; first += kQuantBlock) {
    const int64_t block = first / kQuantBlock;
    const int nb = int(std::min<int64_t>(kQuantBlock, n - first));
    float value[T::kSlots][kQuantBlock];
    for (int slot = 0; slot < T::kSlots; ++slot) {
      if (!T::uses(slot, kFlags)) continue;
      const float absmax = scales[slot][block];
      for (int j = 0; j < nb; ++j) value[slot][j] = quant_decode(codes[slot][first + j], absmax, book[slot]);
    }
    for (int j = 0; j < nb; ++j) {
      float s[T::kSlots];
      for (int slot = 0; slot < T::kSlots; ++slot) s[slot] = T::uses(slot, kFlags) ? value[slot][j] : 0.0f;
      io.store(first + j, T::template update<kFlags>(io.load(first + j), load_as<float>(grad[first + j]), s, k));
      for (int slot = 0; slot < T::kSlots; ++slot) value[slot][j] = s[slot];
    }
    for (int slot = 0; slot < T::kSlots; ++slot) {
      if (!T::uses(slot, kFlags)) continue;
      float absmax = 0.0f;
      for (int j = 0; j < nb; ++j) absmax = absmax_nan(absmax, value[slot][j]);
      scales[slot][block] = absmax;
      for (int j = 0; j < nb; ++j) {
        codes[slot][first + j] = quant_encode(quant_relative(value[slot][j], absmax), first_code[slot], mids[slot]);
      }
    }
  }
}

// One chunk of tensor t in storage S: the state pointers of S, then the loop of S.
template <typename T, int kFlags, StateStorage S, typename IO, typename G, typename C>
void step_chunk_in(const OptimParams& p, size_t t, int64_t first, const IO& io, const G* grad, int64_t n,
                   const typename T::template Consts<C>& k, Draws draws) {
  StateElem<S, C>* state[kMaxStateSlots];
  for (int slot = 0; slot < kMaxStateSlots; ++slot) state[slot] = state_ptr<StateElem<S, C>>(p.state[slot], t, first);
  if constexpr (S == StateStorage::kInt8) {
    float* scales[kMaxStateSlots];
    for (int slot = 0; slot < kMaxStateSlots; ++slot) {
      scales[slot] = state_ptr<float>(p.scales[slot], t, first / kQuantBlock);
    }
    step_blocks<T, kFlags>(io, grad, state, scales, n, k);
  } else {
    step_chunk<T, kFlags, S>(io, grad, state, n, k, draws);
  }
}

}  // namespace

void optim_step(const OptimParams& p) {
  // Skipped: nothing written, steps kept. No params: nothing to step (as on CUDA).
  if (p.params.empty() || (p.found_inf != nullptr && *p.found_inf != 0.0f)) return;
  const double lr = p.lr_ptr ? p.scalars.lr * double(*p.lr_ptr) : p.scalars.lr;
  const double grad_mult = p.grad_mult_ptr ? double(*p.grad_mult_ptr) : 1.0;
  const auto chunks = list_chunks(p.params);
  auto step_of = [&](size_t t) { return p.steps.empty() ? 0.0 : double(*p.steps[p.steps.size() == 1 ? 0 : t]); };

  torch::stable::parallel_for(0, int64_t(chunks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const ChunkRef ref = chunks[c];
      const size_t t = size_t(ref.tensor);
      const int64_t first = ref.first_elem;
      const int64_t n = std::min(kChunkElems, p.params[t].numel - first);
      const double done = step_of(t);
      dispatch_param_grad(p.params[t].dtype, p.grads[t].dtype, [&](auto param_tag, auto grad_tag) {
        using P = decltype(param_tag);
        using G = decltype(grad_tag);
        using C = ComputeOf<P>;
        const G* grad = static_cast<const G*>(p.grads[t].data) + first;
        dispatch_mode<P>(p.mode, [&](auto mode_tag) {
          const ParamIO<P, C, decltype(mode_tag)::value> io{
              static_cast<P*>(p.params[t].data) + first, state_ptr<float>(p.masters, t, first),
              rounding_stream(p.seed, float(done + 1.0)), uint64_t(c) * uint64_t(kChunkElems)};
          dispatch_optim(p.kind, [&](auto traits) {
            using T = decltype(traits);
            const auto k = T::template consts<C>(p.scalars, lr, done, grad_mult);
            dispatch_flags<1 << T::kFlagBits>(optim_flags<T>(p), [&](auto flags) {
              constexpr int kFlags = decltype(flags)::value;
              dispatch_storage(p.storage, [&](auto storage_tag) {
                constexpr StateStorage S = decltype(storage_tag)::value;
                // the binding gives fp64 params fp32 (float64) storage only
                if constexpr (S == StateStorage::kFloat || std::is_same_v<C, float>) {
                  step_chunk_in<T, kFlags, S>(p, t, first, io, grad, n, k, Draws{io.stream, io.position});
                }
              });
            });
          });
        });
      });
    }
  });
  for (float* step : p.steps) *step += 1.0f;
}

}  // namespace gradacc::cpu::GRADACC_CPU_ISA
