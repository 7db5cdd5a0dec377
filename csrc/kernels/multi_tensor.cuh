// Multi-tensor launch machinery shared by every CUDA kernel. Torch-free.
//
// One launch covers up to ListMeta<D>::kCapacity non-empty tensors; one block
// processes one chunk (chunking.h) of one tensor. The metadata travels by
// value as a `const __grid_constant__` kernel parameter: it is never copied
// to device memory, so launches stay CUDA-graph capturable (torch #119153)
// and the kernel reads it straight from the parameter bank.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "chunking.h"
#include "element_math.cuh"

namespace gradacc::cuda {

constexpr int kBlockThreads = 512;
constexpr int kWarps = kBlockThreads / 32;
constexpr int kVec = 8;  // elements per vector step: 16 bytes of a 16-bit type, 32 bytes of fp32
static_assert(kChunkElems % kVec == 0, "chunk starts must keep 16-byte alignment inside a tensor");
static_assert(kChunkElems <= INT32_MAX, "in-chunk offsets are int");

// Kernel parameters may total 32,764 bytes since CUDA 12.1 on sm_70+, 4,096
// before. The metadata takes at most kMetaBudget; the op's other arguments
// live in the remainder (each kernel static_asserts the sum).
#if CUDART_VERSION >= 12010
constexpr size_t kParamLimit = 32764;
constexpr size_t kMetaBudget = 32000;
#else
constexpr size_t kParamLimit = 4096;
constexpr size_t kMetaBudget = 4000;
#endif

// Per-tensor bytes of ListMeta<D>: D pointers, numel, chunk_start, D dtype
// codes, and (D == 1 only) the global tensor index.
constexpr size_t meta_bytes_per_tensor(int depth) {
  return depth * sizeof(void*) + sizeof(int64_t) + sizeof(int32_t) + depth * sizeof(DType) +
         (depth == 1 ? sizeof(int32_t) : 0);
}
constexpr size_t kMetaHeaderBytes = 32;  // first_chunk, num_tensors, the unused index slot, padding

// D = 1: one tensor per slot (norm, scale). D = 2: buf and grad (accumulate).
// Only the norm needs each chunk's global tensor index (for per-tensor norms),
// so D = 2 leaves it out and fits more tensors per launch.
template <int D>
struct ListMeta {
  static constexpr int kCapacity = int((kMetaBudget - kMetaHeaderBytes) / meta_bytes_per_tensor(D));
  static constexpr int kIndexSlots = D == 1 ? kCapacity : 1;

  void* data[D][kCapacity];
  int64_t numel[kCapacity];
  int64_t first_chunk;                // global index of this launch's first chunk
  int32_t chunk_start[kCapacity];     // first chunk of each slot, relative to the launch; ascending
  int32_t tensor_index[kIndexSlots];  // global tensor index of each slot (D == 1)
  int32_t num_tensors;
  DType dtype[D][kCapacity];

  // The slot owning launch-relative chunk `c`: the last slot whose
  // chunk_start is <= c (chunk_start[0] == 0). Uniform across the block.
  __device__ __forceinline__ int locate(int32_t c) const {
    int lo = 0, hi = num_tensors - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (chunk_start[mid] <= c) lo = mid; else hi = mid - 1;
    }
    return lo;
  }
};
static_assert(sizeof(ListMeta<1>) <= kMetaBudget && sizeof(ListMeta<2>) <= kMetaBudget,
              "multi-tensor metadata exceeds its kernel-parameter budget");

// The block's chunk: which slot, where it starts in that tensor, how long it is.
struct BlockChunk {
  int slot;
  int64_t first_elem;
  int n;
};

template <int D>
__device__ __forceinline__ BlockChunk block_chunk(const ListMeta<D>& meta) {
  const int32_t c = int32_t(blockIdx.x);
  const int slot = meta.locate(c);
  const int64_t first = int64_t(c - meta.chunk_start[slot]) * kChunkElems;
  const int64_t left = meta.numel[slot] - first;
  return BlockChunk{slot, first, int(left < kChunkElems ? left : kChunkElems)};
}

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// ---- Raw element access: W = 1 (scalar) or W = kVec (16-byte accesses) ----

template <typename T> __device__ __forceinline__ T from_bits(uint32_t b);
template <> __device__ __forceinline__ float from_bits<float>(uint32_t b) { return bits_float(b); }
template <> __device__ __forceinline__ Half from_bits<Half>(uint32_t b) { return Half{uint16_t(b)}; }
template <> __device__ __forceinline__ BFloat16 from_bits<BFloat16>(uint32_t b) { return BFloat16{uint16_t(b)}; }
__device__ __forceinline__ uint32_t to_bits(float x) { return float_bits(x); }
__device__ __forceinline__ uint32_t to_bits(Half x) { return x.bits; }
__device__ __forceinline__ uint32_t to_bits(BFloat16 x) { return x.bits; }

// W elements of T as 32-bit words (little-endian: element 2k is the low half).
template <typename T, int W>
struct VecWords {
  static constexpr int kWords = W * int(sizeof(T)) / 4;  // 8 for 8 fp32, 4 for 8 16-bit, 2 for 4 16-bit
  static_assert(sizeof(T) == 4 || sizeof(T) == 2, "fp32 or a 16-bit type");
  static_assert(kWords % 4 == 0 || kWords == 2, "whole 16-byte accesses, or one 8-byte access");
  uint32_t w[kWords] = {};

  __device__ __forceinline__ uint32_t get(int i) const {
    if constexpr (sizeof(T) == 4) return w[i];
    else return (w[i >> 1] >> ((i & 1) * 16)) & 0xFFFFu;
  }
  __device__ __forceinline__ void set(int i, uint32_t b) {
    if constexpr (sizeof(T) == 4) w[i] = b;
    else w[i >> 1] |= b << ((i & 1) * 16);  // b < 2^16; the word starts at zero
  }
};

// Reads W elements at p (aligned to their W * sizeof(T) bytes when W > 1):
// 16-byte accesses, or one 8-byte access for 4 elements of a 16-bit type. A
// double (float64 lists of the norm and clip ops) is always read one at a
// time: callers pass vec = false for it, and a W > 1 instantiation reads
// element by element.
template <int W, typename T>
__device__ __forceinline__ void load_raw(const T* p, T (&x)[W]) {
  if constexpr (W == 1 || sizeof(T) == 8) {
#pragma unroll
    for (int i = 0; i < W; ++i) x[i] = p[i];
  } else {
    VecWords<T, W> v;
    if constexpr (VecWords<T, W>::kWords == 2) {
      const uint2 u = *reinterpret_cast<const uint2*>(p);
      v.w[0] = u.x, v.w[1] = u.y;
    } else {
      const uint4* src = reinterpret_cast<const uint4*>(p);
#pragma unroll
      for (int q = 0; q < VecWords<T, W>::kWords / 4; ++q) {
        const uint4 u = src[q];
        v.w[4 * q] = u.x, v.w[4 * q + 1] = u.y, v.w[4 * q + 2] = u.z, v.w[4 * q + 3] = u.w;
      }
    }
#pragma unroll
    for (int i = 0; i < W; ++i) x[i] = from_bits<T>(v.get(i));
  }
}

template <int W, typename T>
__device__ __forceinline__ void store_raw(T* p, const T (&x)[W]) {
  if constexpr (W == 1 || sizeof(T) == 8) {
#pragma unroll
    for (int i = 0; i < W; ++i) p[i] = x[i];
  } else {
    VecWords<T, W> v;
#pragma unroll
    for (int i = 0; i < W; ++i) v.set(i, to_bits(x[i]));
    if constexpr (VecWords<T, W>::kWords == 2) {
      *reinterpret_cast<uint2*>(p) = make_uint2(v.w[0], v.w[1]);
    } else {
      uint4* dst = reinterpret_cast<uint4*>(p);
#pragma unroll
      for (int q = 0; q < VecWords<T, W>::kWords / 4; ++q) {
        dst[q] = make_uint4(v.w[4 * q], v.w[4 * q + 1], v.w[4 * q + 2], v.w[4 * q + 3]);
      }
    }
  }
}

template <int W>
struct Width {
  static constexpr int value = W;
};

// Calls fn(Width<W>{}, i) for this thread's share of the chunk's n elements,
// in groups of kW (kVec unless a kernel picks fewer to save registers).
// Thread t owns the groups starting at kW * t, kW * (t + 512), ... below
// n - n % kW: one call with vector accesses per group when `vec` (every
// pointer 16-byte aligned), else kW scalar calls in element order. The last
// n % kW elements (only in a tensor's last chunk) go one per thread. Each
// thread therefore visits the same elements in the same order on both
// paths: norm partials do not depend on the tensors' alignment.
// The two paths are two loops, not one loop with a branch: ptxas does not
// unswitch it, and the vector loop would otherwise hold the scalar path's
// kW accesses per list too (scripts/kernel_report.py counts them).
template <int kW = kVec, typename F>
__device__ __forceinline__ void for_each_group(int n, bool vec, F&& fn) {
  static_assert(kChunkElems % kW == 0, "chunk starts must keep the groups aligned inside a tensor");
  const int tail_from = n - n % kW;
  const int first = int(threadIdx.x) * kW;
  constexpr int kStride = kBlockThreads * kW;
  if (vec) {
    for (int i = first; i < tail_from; i += kStride) fn(Width<kW>{}, i);
  } else {
    for (int i = first; i < tail_from; i += kStride) {
#pragma unroll
      for (int j = 0; j < kW; ++j) fn(Width<1>{}, i + j);
    }
  }
  if (int(threadIdx.x) < n - tail_from) fn(Width<1>{}, tail_from + int(threadIdx.x));
}

// Calls fn(Width<1>{}, i) for elements t, t + 512, ... of the chunk, one at a
// time: for the paths that never take 16-byte accesses (float64, the norm's
// generic kinds). Unrolling kVec calls of their heavy element math, as
// for_each_group's scalar path does, only adds registers (sm_100 spilled).
template <typename F>
__device__ __forceinline__ void for_each_element(int n, F&& fn) {
  for (int i = int(threadIdx.x); i < n; i += kBlockThreads) fn(Width<1>{}, i);
}

// ---- Deterministic block reduction of norm statistics ----

// Fixed-shape tree (warp shuffles, then warp 0 over the per-warp results):
// same inputs, same bits. The result is valid in thread 0. Every thread of
// the block must call it. `kind` picks the merge (the -inf norm keeps a min).
template <typename A>
__device__ __forceinline__ NormAccT<A> block_reduce(NormAccT<A> a, NormKind kind = NormKind::kL2) {
  __shared__ NormAccT<A> warp_acc[kWarps];
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    a = norm_acc_merge(
        a, NormAccT<A>{__shfl_down_sync(0xFFFFFFFFu, a.sumsq, off), __shfl_down_sync(0xFFFFFFFFu, a.maxabs, off)},
        kind);
  }
  if (lane == 0) warp_acc[warp] = a;
  __syncthreads();
  if (warp == 0) {
    a = lane < kWarps ? warp_acc[lane] : norm_acc_init<A>(kind);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
      a = norm_acc_merge(
          a, NormAccT<A>{__shfl_down_sync(0xFFFFFFFFu, a.sumsq, off), __shfl_down_sync(0xFFFFFFFFu, a.maxabs, off)},
          kind);
    }
  }
  return a;
}

}  // namespace gradacc::cuda
