// CPU kernels of the fused optimizer steps: one parallel pass over params,
// grads and state, chunked like every other op (csrc/kernels/chunking.h).
// The element math is each optimizer's update (csrc/kernels/optim_traits.cuh),
// shared with CUDA; nothing here names an optimizer.
// Compiled once per ISA into namespace GRADACC_CPU_ISA (isa.h, setup.py).
#include "optim_cpu.h"

#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <type_traits>

#include "../kernels/chunking.h"
#include "../kernels/optim_dispatch.cuh"

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

template <typename C> C* state_ptr(const std::vector<Span>& list, size_t t, int64_t first) {
  return list.empty() ? nullptr : static_cast<C*>(list[t].data) + first;
}

// One chunk of optimizer T in variant kFlags; state[s] is null for a slot the variant does not use.
template <typename T, int kFlags, typename IO, typename G, typename C>
void step_chunk(const IO& io, const G* grad, C* const* state, int64_t n, const typename T::template Consts<C>& k) {
  C* st[T::kSlots];  // local copies, so the loop provably keeps them
  for (int slot = 0; slot < T::kSlots; ++slot) st[slot] = state[slot];
  for (int64_t i = 0; i < n; ++i) {
    C s[T::kSlots];
    for (int slot = 0; slot < T::kSlots; ++slot) s[slot] = T::uses(slot, kFlags) ? st[slot][i] : C(0);
    io.store(i, T::template update<kFlags>(io.load(i), load_as<C>(grad[i]), s, k));
    for (int slot = 0; slot < T::kSlots; ++slot) {
      if (T::uses(slot, kFlags)) st[slot][i] = s[slot];
    }
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
            C* state[kMaxStateSlots];
            for (int slot = 0; slot < kMaxStateSlots; ++slot) state[slot] = state_ptr<C>(p.state[slot], t, first);
            dispatch_flags<1 << T::kFlagBits>(optim_flags<T>(p), [&](auto flags) {
              step_chunk<T, decltype(flags)::value>(io, grad, state, n, k);
            });
          });
        });
      });
    }
  });
  for (float* step : p.steps) *step += 1.0f;
}

}  // namespace gradacc::cpu::GRADACC_CPU_ISA
