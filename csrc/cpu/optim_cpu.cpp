// CPU kernels of the fused optimizer steps: one parallel pass over params,
// grads and state, chunked like every other op (csrc/kernels/chunking.h).
// The element math is csrc/kernels/optim_math.cuh, shared with CUDA.
// Compiled once per ISA into namespace GRADACC_CPU_ISA (isa.h, setup.py).
#include "optim_cpu.h"

#include <ATen/Parallel.h>

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

template <bool kAmsgrad, typename IO, typename G, typename C>
void adamw_chunk(const IO& io, const G* grad, C* m, C* v, C* vmax, int64_t n, const AdamConsts<C>& k) {
  for (int64_t i = 0; i < n; ++i) {
    C unused = C(0);
    C& vm = kAmsgrad ? vmax[i] : unused;
    io.store(i, adamw_value<kAmsgrad>(io.load(i), load_as<C>(grad[i]), m[i], v[i], vm, k));
  }
}

template <bool kMomentum, bool kNesterov, bool kDecay, typename IO, typename G, typename C>
void sgd_chunk(const IO& io, const G* grad, C* buf, int64_t n, const SgdConsts<C>& k) {
  for (int64_t i = 0; i < n; ++i) {
    C unused = C(0);
    C& b = kMomentum ? buf[i] : unused;
    io.store(i, sgd_value<kMomentum, kNesterov, kDecay>(io.load(i), load_as<C>(grad[i]), b, k));
  }
}

// Calls f(std::bool_constant<B>{}) for a runtime flag.
template <typename F>
void with_flag(bool b, F&& f) {
  if (b) f(std::true_type{}); else f(std::false_type{});
}

}  // namespace

void optim_step(const OptimParams& p) {
  // Skipped: nothing written, steps kept. No params: nothing to step (as on CUDA).
  if (p.params.empty() || (p.found_inf != nullptr && *p.found_inf != 0.0f)) return;
  const double lr = p.lr_ptr ? p.scalars.lr * double(*p.lr_ptr) : p.scalars.lr;
  const double grad_mult = p.grad_mult_ptr ? double(*p.grad_mult_ptr) : 1.0;
  const auto chunks = list_chunks(p.params);
  auto step_of = [&](size_t t) { return p.steps.empty() ? 0.0 : double(*p.steps[p.steps.size() == 1 ? 0 : t]); };

  at::parallel_for(0, int64_t(chunks.size()), 1, [&](int64_t begin, int64_t end) {
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
          if (p.kind == OptimKind::kAdamW) {
            const auto k = adam_consts<C>(p.scalars, lr, done + 1.0, grad_mult);
            C* m = state_ptr<C>(p.state[0], t, first);
            C* v = state_ptr<C>(p.state[1], t, first);
            C* vmax = state_ptr<C>(p.state[2], t, first);
            with_flag(vmax != nullptr, [&](auto ams) { adamw_chunk<decltype(ams)::value>(io, grad, m, v, vmax, n, k); });
            return;
          }
          const auto k = sgd_consts<C>(p.scalars, lr, done, grad_mult);
          C* buf = state_ptr<C>(p.state[0], t, first);
          with_flag(buf != nullptr, [&](auto mom) {
            with_flag(p.scalars.nesterov, [&](auto nest) {
              with_flag(p.scalars.weight_decay != 0.0, [&](auto decay) {
                sgd_chunk<decltype(mom)::value, decltype(nest)::value, decltype(decay)::value>(io, grad, buf, n, k);
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
