// CPU kernels. Work is split into the chunks of csrc/kernels/chunking.h and
// run with at::parallel_for; each chunk keeps its own norm partial, and the
// partials are merged in chunk order, so results do not depend on threads.
#include "kernels_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>

#include "../kernels/chunking.h"
#include "../kernels/dispatch.cuh"

namespace gradacc::cpu {
namespace {

// Norm statistics of n values, in kLanes independent accumulators so the
// loop vectorises; the lanes merge in a fixed order (deterministic).
constexpr int kLanes = 16;

template <typename T>
NormAcc reduce_norm(const T* __restrict x, int64_t n) {
  // norm_acc_add written out on plain arrays (max_abs_nan as an integer max
  // of |x|'s bits): the same arithmetic, in a shape GCC vectorises.
  float sumsq[kLanes] = {};
  uint32_t maxbits[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float v = Elem<T>::load(x[i + l]);
      sumsq[l] = add_rn(sumsq[l], mul_rn(v, v));
      const uint32_t b = float_bits(v) & 0x7FFFFFFFu;
      maxbits[l] = b > maxbits[l] ? b : maxbits[l];
    }
  }
  NormAcc total = norm_acc_init();
  for (; i < n; ++i) total = norm_acc_add(total, Elem<T>::load(x[i]));
  for (int l = 0; l < kLanes; ++l) total = norm_acc_merge(total, NormAcc{sumsq[l], bits_float(maxbits[l])});
  return total;
}

// Any norm kind in accumulator type A (double for a list that holds float64
// data), in kLanes accumulators like the fast path: a chunk's sum then rounds
// like kLanes short sums (sqrt(n / kLanes) growth), not one long one; the
// lanes merge in a fixed order (deterministic). fp32 L2/inf takes the fast path.
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

// Runs `chunk_fn(chunk_index, chunk_ref)` over every chunk of `spans` in parallel.
template <typename SpanVec, typename F>
void for_each_chunk(const SpanVec& spans, const std::vector<ChunkRef>& chunks, F&& chunk_fn) {
  at::parallel_for(0, int64_t(chunks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) chunk_fn(c, chunks[c]);
  });
}

float effective_alpha(const AccumulateParams& p) {
  return p.alpha_ptr ? mul_rn(p.alpha, *p.alpha_ptr) : p.alpha;
}

template <typename B, typename G>
void accumulate_chunk(B* buf, const G* grad, int64_t n, float alpha, bool assign) {
  for (int64_t i = 0; i < n; ++i) {
    buf[i] = Elem<B>::store(accumulate_value(Elem<B>::load(buf[i]), Elem<G>::load(grad[i]), alpha, assign));
  }
}

// The final micro-step: store, then take the statistics of what was stored
// (a low-precision buffer may round a finite fp32 value to Inf, and that is
// what the optimizer reads). The second pass hits cache: a chunk is small.
template <typename B, typename G>
NormAcc accumulate_final_chunk(B* buf, const G* grad, int64_t n, float alpha, bool assign, float inv_scale) {
  for (int64_t i = 0; i < n; ++i) {
    buf[i] = Elem<B>::store(
        accumulate_final_value(Elem<B>::load(buf[i]), Elem<G>::load(grad[i]), alpha, assign, inv_scale));
  }
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
  const float inv_scale = p.inv_scale_ptr ? *p.inv_scale_ptr : 1.0f;
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
        partials[c] = accumulate_final_chunk(buf, grad, n, alpha, p.assign, inv_scale);
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
  *p.norm_out = norm_acc_result(total, p.norm_kind);
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
        for (int64_t i = 0; i < n; ++i) x[i] = Elem<T>::store(clip_value(Elem<T>::load(x[i]), v));
      } else {
        if (p.mode == ScaleMode::kUnscale && !is_finite(reduce_norm(x, n).maxabs)) {
          found.store(true, std::memory_order_relaxed);  // checked on the input, as torch's unscale does
        }
        for (int64_t i = 0; i < n; ++i) x[i] = Elem<T>::store(mul_rn(Elem<T>::load(x[i]), factor));
      }
    });
  });
  if (p.mode == ScaleMode::kUnscale && found.load()) *p.found_inf = 1.0f;
}

}  // namespace gradacc::cpu
