// Deterministic global (and per-tensor) norm. Torch-free.
//
// Pass 1 (one or more multi-tensor launches): each block reduces its chunk
// to a NormAcc partial at partials[global chunk], and records the chunk's
// tensor in chunk_tensor. Pass 2 (norm_finalize_kernel, one launch): block 0
// merges every partial into the total, block 1 + t merges tensor t's chunks.
// Fixed per-thread order and fixed reduction trees, no float atomics: the
// result is bitwise reproducible. The accumulate final step reuses pass 2 (adding into its running partial).
#pragma once

#include <type_traits>

#include "dispatch.cuh"
#include "multi_tensor.cuh"

namespace gradacc::cuda {

// A = float, or double for a list that holds float64 data (NormParams::wide).
template <typename A>
struct NormArgs {
  NormAccT<A>* partials;  // one per global chunk
  int32_t* chunk_tensor;  // one per global chunk: its tensor's index in the list
  double p;               // the order, for NormKind::kP
  NormKind kind;
};
static_assert(sizeof(ListMeta<1>) + sizeof(NormArgs<double>) <= kParamLimit, "norm kernel parameters");

// kFast: the fp32 L2 / inf path (16-byte loads, norm_acc_add without a
// per-element switch). Otherwise any kind, with the same per-element math as
// the CPU kernel, reading one element at a time (for_each_element): pow
// dominates there, and holding a vector of values live across its calls, or
// unrolling them, spills registers (sm_100 did, scripts/kernel_report.py).
// A float accumulator never meets float64 data (the binding widens such a
// list to A = double), so only A = double dispatches on it.
template <typename A, bool kFast>
__global__ void __launch_bounds__(kBlockThreads)
    norm_kernel(const __grid_constant__ ListMeta<1> meta, const NormArgs<A> args) {
  const BlockChunk c = block_chunk(meta);
  NormAccT<A> acc = norm_acc_init<A>(args.kind);
  const auto reduce = [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(meta.data[0][c.slot]) + c.first_elem;
    if constexpr (kFast && std::is_same_v<A, float> && !std::is_same_v<T, double>) {
      for_each_group(c.n, aligned16(x), [&](auto width, int i) {
        constexpr int W = decltype(width)::value;
        T v[W];
        load_raw<W>(x + i, v);
#pragma unroll
        for (int k = 0; k < W; ++k) acc = norm_acc_add(acc, Elem<T>::load(v[k]));
      });
    } else {
      for_each_element(c.n, [&](auto, int i) { acc = norm_acc_add(acc, load_as<A>(x[i]), args.kind, args.p); });
    }
  };
  if constexpr (std::is_same_v<A, double>) {
    dispatch_dtype_f64(meta.dtype[0][c.slot], reduce);
  } else {
    dispatch_dtype(meta.dtype[0][c.slot], reduce);
  }
  const NormAccT<A> total = block_reduce(acc, args.kind);
  if (threadIdx.x == 0) {
    const int64_t g = meta.first_chunk + blockIdx.x;
    args.partials[g] = total;
    args.chunk_tensor[g] = meta.tensor_index[c.slot];
  }
}

// First index in sorted keys[0, n) whose key is >= value.
__device__ __forceinline__ int64_t lower_bound(const int32_t* keys, int64_t n, int32_t value) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] < value) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Grid: 1 block for the total, plus one per tensor when per_tensor_out is set
// (then chunk_tensor must be filled). With no chunks at all every output is 0.
// add_to_total (the accumulate final step; fp32 kL2/kInf): *total_out is a running partial, and the
// statistic is added into it (norm_partial_add) instead of the norm overwriting it.
template <typename A>
__global__ void __launch_bounds__(kBlockThreads)
    norm_finalize_kernel(const NormAccT<A>* partials, const int32_t* chunk_tensor, int64_t num_chunks, NormKind kind,
                         double p, A* total_out, A* per_tensor_out, bool add_to_total) {
  int64_t begin = 0, end = num_chunks;
  if (blockIdx.x > 0) {
    const int32_t t = int32_t(blockIdx.x - 1);
    begin = lower_bound(chunk_tensor, num_chunks, t);
    end = lower_bound(chunk_tensor, num_chunks, t + 1);
  }
  NormAccT<A> acc = norm_acc_init<A>(kind);
  for (int64_t i = begin + threadIdx.x; i < end; i += kBlockThreads) acc = norm_acc_merge(acc, partials[i], kind);
  acc = block_reduce(acc, kind);
  if (threadIdx.x != 0) return;
  if constexpr (std::is_same_v<A, float>) {
    if (add_to_total) {
      *total_out = norm_partial_add(*total_out, acc, kind);
      return;
    }
  }
  const A result = norm_acc_result(acc, kind, p);
  if (blockIdx.x == 0) *total_out = result;
  else per_tensor_out[blockIdx.x - 1] = result;
}

}  // namespace gradacc::cuda
