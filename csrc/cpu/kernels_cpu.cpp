// CPU kernels. Work is split into the chunks of csrc/kernels/chunking.h and
// run with torch::stable::parallel_for; each chunk keeps its own norm partial, and the
// partials are merged in chunk order, so results do not depend on threads.
// Compiled once per ISA into namespace GRADACC_CPU_ISA (isa.h, setup.py).
#include "kernels_cpu.h"

#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <atomic>

#include "../kernels/chunking.h"
#include "../kernels/dispatch.cuh"
#include "loops_cpu.h"

namespace gradacc::cpu::GRADACC_CPU_ISA {
namespace {

// Any norm kind in accumulator type A (double for a list that holds float64
// data), in kLanes accumulators like the fast path: a chunk's sum then rounds
// like kLanes short sums (sqrt(n / kLanes) growth), not one long one; the
// lanes merge in a fixed order (deterministic). fp32 L2/inf takes the fast path
// (reduce_norm in loops_cpu.h, which this overload would hide).
using GRADACC_CPU_ISA::reduce_norm;
template <typename A, typename T>
NormAccT<A> reduce_norm(const T* __restrict x, int64_t n, NormKind kind, double p) {
  if constexpr (std::is_same_v<A, float> && !std::is_same_v<T, double>) {
    if (kind == NormKind::kL2 || kind == NormKind::kInf) return reduce_norm(x, n);
  }
  NormAccT<A> lanes[kLanes];
  for (auto& lane : lanes) lane = norm_acc_init<A>(kind);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] = norm_acc_add(lanes[l], load_as<A>(x[i + l]), kind, p);
  }
  NormAccT<A> total = norm_acc_init<A>(kind);
  for (; i < n; ++i) total = norm_acc_add(total, load_as<A>(x[i]), kind, p);
  for (const auto& lane : lanes) total = norm_acc_merge(total, lane, kind);
  return total;
}

// Elements per thread at the least: torch's element-wise grain
// (at::internal::GRAIN_SIZE in TensorIterator.h, not included for one constant).
constexpr int64_t kParallelGrain = 32768;

// Runs `chunk_fn(chunk_index, chunk_ref)` over every chunk of `spans`. The
// threads split the list's elements, not its chunks or tensors: each takes
// the chunks that start in its equal share of all elements (2,000 tiny
// tensors or a few large ones balance alike), and a list of fewer than
// kParallelGrain elements runs on the calling thread. Which thread runs a
// chunk never changes its result.
template <typename SpanVec, typename F>
void for_each_chunk(const SpanVec& spans, const std::vector<ChunkRef>& chunks, F&& chunk_fn) {
  std::vector<int64_t> starts(chunks.size());  // the list-wide index of each chunk's first element
  int64_t total = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    starts[c] = total;
    total += std::min(kChunkElems, spans[chunks[c].tensor].numel - chunks[c].first_elem);
  }
  torch::stable::parallel_for(0, total, kParallelGrain, [&](int64_t begin, int64_t end) {
    const auto first = std::lower_bound(starts.begin(), starts.end(), begin) - starts.begin();
    const auto last = std::lower_bound(starts.begin(), starts.end(), end) - starts.begin();
    for (int64_t c = first; c < last; ++c) chunk_fn(c, chunks[c]);
  });
}

float effective_alpha(const AccumulateParams& p) {
  return p.alpha_ptr ? mul_rn(p.alpha, *p.alpha_ptr) : p.alpha;
}

template <typename B, typename G>
void accumulate_chunk(B* buf, const G* grad, int64_t n, float alpha, bool assign) {
  map2_inplace(buf, grad, n, [&](float b, float g) { return accumulate_value(b, g, alpha, assign); });
}

// A bucket of the window's last fold: store, then take the statistics of what was stored
// (a low-precision buffer may round a finite fp32 value to Inf, and that is
// what the optimizer reads). The second pass hits cache: a chunk is small.
template <typename B, typename G>
NormAcc accumulate_final_chunk(B* buf, const G* grad, int64_t n, float alpha, bool assign) {
  accumulate_chunk(buf, grad, n, alpha, assign);
  return reduce_norm(buf, n);
}

// Merges per-chunk partials into the total and, optionally, per-tensor norms.
template <typename A>
void finish_norm(const std::vector<ChunkRef>& chunks, const std::vector<NormAccT<A>>& partials,
                 const NormParams& p) {
  NormAccT<A> total = norm_acc_init<A>(p.norm_kind);
  for (const auto& part : partials) total = norm_acc_merge(total, part, p.norm_kind);
  *static_cast<A*>(p.total_out) = norm_acc_result(total, p.norm_kind, p.p);
  if (p.per_tensor_out == nullptr) return;
  std::vector<NormAccT<A>> per(p.tensors.size(), norm_acc_init<A>(p.norm_kind));
  for (size_t c = 0; c < chunks.size(); ++c) {
    per[chunks[c].tensor] = norm_acc_merge(per[chunks[c].tensor], partials[c], p.norm_kind);
  }
  A* out = static_cast<A*>(p.per_tensor_out);
  for (size_t t = 0; t < per.size(); ++t) out[t] = norm_acc_result(per[t], p.norm_kind, p.p);
}

template <typename A>
void norm_in(const NormParams& p) {
  const auto chunks = list_chunks(p.tensors);
  std::vector<NormAccT<A>> partials(chunks.size());
  for_each_chunk(p.tensors, chunks, [&](int64_t c, const ChunkRef& ref) {
    const Span& s = p.tensors[ref.tensor];
    const int64_t n = std::min(kChunkElems, s.numel - ref.first_elem);
    dispatch_dtype_f64(s.dtype, [&](auto tag) {
      using T = decltype(tag);
      partials[c] = reduce_norm<A>(static_cast<const T*>(s.data) + ref.first_elem, n, p.norm_kind, p.p);
    });
  });
  finish_norm(chunks, partials, p);
}

}  // namespace

void accumulate(const AccumulateParams& p) {
  const auto chunks = list_chunks(p.bufs);
  const float alpha = effective_alpha(p);
  std::vector<NormAcc> partials(p.final_step ? chunks.size() : 0);

  for_each_chunk(p.bufs, chunks, [&](int64_t c, const ChunkRef& ref) {
    const Span& b = p.bufs[ref.tensor];
    const Span& g = p.grads[ref.tensor];
    const int64_t n = std::min(kChunkElems, b.numel - ref.first_elem);
    dispatch_buf_grad(b.dtype, g.dtype, [&](auto buf_tag, auto grad_tag) {
      using B = decltype(buf_tag);
      using G = decltype(grad_tag);
      B* buf = static_cast<B*>(b.data) + ref.first_elem;
      const G* grad = static_cast<const G*>(g.data) + ref.first_elem;
      if (p.final_step) {
        partials[c] = accumulate_final_chunk(buf, grad, n, alpha, p.assign);
      } else {
        accumulate_chunk(buf, grad, n, alpha, p.assign);
      }
    });
  });

  if (!p.final_step) return;
  // max |x| is non-finite exactly when some stored value is Inf or NaN.
  NormAcc total = norm_acc_init();
  for (const auto& part : partials) total = norm_acc_merge(total, part);
  if (!is_finite(total.maxabs)) *p.found_inf = 1.0f;
  *p.norm_acc = norm_partial_add(*p.norm_acc, total, p.norm_kind);
}

void norm(const NormParams& p) {
  if (p.wide) {
    norm_in<double>(p);
  } else {
    norm_in<float>(p);
  }
}

void scale(const ScaleParams& p) {
  float factor = 1.0f;
  double factor_f64 = 1.0;  // float64 tensors are clipped in double, as torch does
  if (p.mode == ScaleMode::kUnscale) factor = *p.inv_scale_ptr;
  if (p.mode == ScaleMode::kClipNorm) {
    factor = clip_coefficient(load_scalar<float>(p.norm_ptr, p.norm_dtype), float(p.max_norm), float(p.eps));
    factor_f64 = clip_coefficient(load_scalar<double>(p.norm_ptr, p.norm_dtype), p.max_norm, p.eps);
    if (factor >= 1.0f && factor_f64 >= 1.0) return;  // nothing to clip: leave memory untouched
  }
  const auto chunks = list_chunks(p.tensors);
  std::atomic<bool> found{false};
  for_each_chunk(p.tensors, chunks, [&](int64_t, const ChunkRef& ref) {
    const Span& s = p.tensors[ref.tensor];
    const int64_t n = std::min(kChunkElems, s.numel - ref.first_elem);
    dispatch_dtype_f64(s.dtype, [&](auto tag) {
      using T = decltype(tag);
      T* x = static_cast<T*>(s.data) + ref.first_elem;
      if constexpr (std::is_same_v<T, double>) {  // the clips only (the binding refuses float64 for unscale_)
        for (int64_t i = 0; i < n; ++i) {
          x[i] = p.mode == ScaleMode::kClipValue ? clip_value(x[i], p.clip_value) : Arith<double>::mul(x[i], factor_f64);
        }
      } else if (p.mode == ScaleMode::kClipValue) {
        const float v = float(p.clip_value);
        map_inplace(x, n, [&](float e) { return clip_value(e, v); });
      } else if (p.mode == ScaleMode::kUnscale) {
        if (!unscale_chunk(x, n, factor)) found.store(true, std::memory_order_relaxed);
      } else {
        map_inplace(x, n, [&](float e) { return mul_rn(e, factor); });
      }
    });
  });
  if (p.mode == ScaleMode::kUnscale && found.load()) *p.found_inf = 1.0f;
}

}  // namespace gradacc::cpu::GRADACC_CPU_ISA
