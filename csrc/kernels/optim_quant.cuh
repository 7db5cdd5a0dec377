// The int8 (blockwise-quantized) state path of the fused optimizer kernel (optim_step.cuh):
// dequantize, update, requantize in the pass that reads the grads (LOWBIT_SPEC.md section 3).
// Torch-free; the host emulation (tests/emulation) compiles it with g++.
//
// One warp per block of kQuantBlock (256) elements, 8 per lane, so the block's new absmax is one
// warp reduction (shuffles, no barrier) and lane 0 writes the block's scale. A chunk (65,536
// elements) holds whole quantization blocks, the last block of a tensor may be partial. Aligned
// chunks take each lane's 8 elements contiguously: the codes as one 64-bit access, 16-byte
// accesses for the rest; a warp iteration may take several consecutive blocks, their loads all
// issued first (optim_step.cuh's kQuantBlocksPerStep). The others (and a partial last block) take
// element e of lane l at l + 32 e: one coalesced scalar access per list. The code books (values and
// midpoints) sit in shared memory, copied once per block from their device copy: a code's value and
// the 8-step midpoint search (quant_encode_search) read them with data-dependent indices.
#pragma once

#include "optim_io.cuh"

namespace gradacc::cuda {

constexpr int kLaneElems = kQuantBlock / 32;  // 8
static_assert(kChunkElems % kQuantBlock == 0, "a chunk holds whole quantization blocks");
static_assert(kBlockThreads >= kQuantBlock, "one thread per code-book entry copies the books");

// The two code books (index 1: signed, 0: unsigned) and their midpoints (255 used of 256).
struct QuantBooks {
  float codes[2][kQuantBlock];
  float mids[2][kQuantBlock];
};

struct NoBooks {};  // the shared memory of the other storages' kernels

constexpr QuantBooks make_quant_books() {
  QuantBooks b{};
  for (int i = 0; i < 256; ++i) {
    b.codes[1][i] = kSignedCodes[i];
    b.codes[0][i] = kUnsignedCodes[i];
    if (i < 255) b.mids[1][i] = kSignedMidpoints[i], b.mids[0][i] = kUnsignedMidpoints[i];
  }
  return b;
}

// The device copy, built at compile time from quant_maps.h.
__device__ const QuantBooks kDeviceQuantBooks = make_quant_books();

// The book of slot s of optimizer T: 1 (signed) or 0 (unsigned), a compile-time constant.
template <typename T, int s>
constexpr int kBookOf = T::kStateSigned[s] ? 1 : 0;

// Calls f(std::integral_constant<int, s>{}) for every state slot s that variant kFlags of T uses.
template <typename T, int kFlags, typename F, int... S>
__device__ __forceinline__ void for_used_slots_in(F&& f, std::integer_sequence<int, S...>) {
  ((T::uses(S, kFlags) ? (f(std::integral_constant<int, S>{}), 0) : 0), ...);
}
template <typename T, int kFlags, typename F>
__device__ __forceinline__ void for_used_slots(F&& f) {
  for_used_slots_in<T, kFlags>(f, std::make_integer_sequence<int, T::kSlots>{});
}

// Copies the books the variant's slots use into shared memory; every thread of the block calls it.
template <typename T, int kFlags>
__device__ __forceinline__ void load_quant_books(QuantBooks& books) {
  const int i = int(threadIdx.x);
  if (i < kQuantBlock) {
    for_used_slots<T, kFlags>([&](auto slot) {
      constexpr int b = kBookOf<T, decltype(slot)::value>;
      books.codes[b][i] = kDeviceQuantBooks.codes[b][i];
      books.mids[b][i] = kDeviceQuantBooks.mids[b][i];
    });
  }
  __syncthreads();
}

// The largest of 32 lanes' |x| bit patterns: for non-negative floats and NaNs with the sign bit
// cleared the patterns order like the values, every NaN above +Inf (absmax_nan's result, with any
// NaN payload). A butterfly: every lane gets it, on every architecture (sm_70 included).
__device__ __forceinline__ uint32_t warp_max_bits(uint32_t m) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    const uint32_t o = __shfl_xor_sync(0xFFFFFFFFu, m, off);
    m = o > m ? o : m;
  }
  return m;
}

// The int8 slots of one chunk: codes (the param's shape) and block absmaxes (from the chunk's first block).
template <int kSlots>
struct QuantSlots {
  uint8_t* codes[kSlots];
  float* scales[kSlots];
};

// The code of element e from 8 codes read as one 64-bit access (little-endian).
__device__ __forceinline__ uint8_t code_at(const uint2& u, int e) {
  return uint8_t(((e < 4 ? u.x : u.y) >> (8 * (e % 4))) & 0xFFu);
}

// What one lane reads of one quantization block in the contiguous layout: its 8 params (or master
// weights) and grads, and each used slot's 8 codes (one 64-bit access) and the block's old absmax.
template <int kSlots, typename C>
struct LaneBlock {
  C p[kLaneElems], g[kLaneElems];
  alignas(8) uint2 codes[kSlots];  // as CUDA's uint2 is; the host emulation's is not (its 8-byte accesses are checked)
  float old[kSlots];
};

template <typename T, int kFlags, typename IO, typename C>
__device__ __forceinline__ void load_lane_block(const IO& io, const QuantSlots<T::kSlots>& q, int block, int first,
                                                LaneBlock<T::kSlots, C>& x) {
  for_used_slots<T, kFlags>([&](auto slot) { x.old[decltype(slot)::value] = q.scales[decltype(slot)::value][block]; });
  io.template load<kLaneElems>(first, x.p, x.g);
  for_used_slots<T, kFlags>([&](auto slot) {
    x.codes[decltype(slot)::value] = *reinterpret_cast<const uint2*>(q.codes[decltype(slot)::value] + first);
  });
}

// Dequantizes and updates the 8 elements of x (loaded from `first`), stores their params and leaves
// their new state values in st.
template <typename T, int kFlags, typename IO, typename C, typename K>
__device__ __forceinline__ void update_lane_block(const IO& io, const QuantBooks& books, LaneBlock<T::kSlots, C>& x,
                                                  int first, const K& consts, C (&st)[T::kSlots][kLaneElems]) {
  constexpr int E = kLaneElems;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    for_used_slots<T, kFlags>([&](auto slot) {
      constexpr int s = decltype(slot)::value;
      st[s][e] = quant_decode(code_at(x.codes[s], e), x.old[s], books.codes[kBookOf<T, s>]);
    });
    x.p[e] = T::template update<kFlags>(x.p[e], x.g[e], Column<C, T::kSlots, E>{st, e}, consts);
  }
  io.template store<E>(first, x.p);
}

// The strided layout of one quantization block: this lane's element e at first + 32 e while below
// n, each one loaded, dequantized, updated and stored on its own, its new state values left in st
// (elements past n leave 0). Not unrolled (one copy of the update, which left ptxas no room beside
// the contiguous path): the new values shift into st from the top, so that st is only ever indexed
// by constants (a runtime index would put it in local memory); after the 8 steps st[s][e] is
// element e's.
template <typename T, int kFlags, typename IO, typename C, typename K>
__device__ __forceinline__ void update_strided_block(const IO& io, const QuantSlots<T::kSlots>& q,
                                                     const QuantBooks& books, int block, int first, int n,
                                                     const K& consts, C (&st)[T::kSlots][kLaneElems]) {
  constexpr int E = kLaneElems;
  float old[T::kSlots] = {};
  for_used_slots<T, kFlags>([&](auto slot) { old[decltype(slot)::value] = q.scales[decltype(slot)::value][block]; });
#pragma unroll 1
  for (int e = 0; e < E; ++e) {
    const int i = first + 32 * e;
    C v[T::kSlots][1] = {};
    if (i < n) {
      C p[1], g[1];
      io.template load<1>(i, p, g);
      for_used_slots<T, kFlags>([&](auto slot) {
        constexpr int s = decltype(slot)::value;
        v[s][0] = quant_decode(q.codes[s][i], old[s], books.codes[kBookOf<T, s>]);
      });
      p[0] = T::template update<kFlags>(p[0], g[0], Column<C, T::kSlots, 1>{v, 0}, consts);
      io.template store<1>(i, p);
    }
#pragma unroll
    for (int s = 0; s < T::kSlots; ++s) {
#pragma unroll
      for (int k = 0; k + 1 < E; ++k) st[s][k] = st[s][k + 1];
      st[s][E - 1] = v[s][0];
    }
  }
}

// Requantizes this lane's new state values st of one quantization block (index `block` in the chunk
// of n elements) in every used slot: the block's new absmax (one warp reduction), the codes, and lane
// 0's scale. kContiguous: the lane's 8 elements from `first`, else at first + 32 e; elements past n
// (strided layout only) hold 0 and take no part.
template <bool kContiguous, typename T, int kFlags, typename C>
__device__ __forceinline__ void requantize_block(const QuantSlots<T::kSlots>& q, const QuantBooks& books, int block,
                                                 int first, int n, const C (&st)[T::kSlots][kLaneElems]) {
  constexpr int E = kLaneElems;
  auto valid = [&](int e) { return kContiguous || first + 32 * e < n; };
  for_used_slots<T, kFlags>([&](auto slot) {
    constexpr int s = decltype(slot)::value;
    const float* mids = books.mids[kBookOf<T, s>];
    uint32_t m = 0;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const uint32_t b = float_bits(abs_f(st[s][e]));
      if (valid(e) && b > m) m = b;
    }
    const float absmax = bits_float(warp_max_bits(m));
    uint8_t code[E];
#pragma unroll
    for (int e = 0; e < E; ++e) code[e] = quant_encode_search(quant_relative(st[s][e], absmax), mids);
    if constexpr (kContiguous) {
      uint2 u;
      u.x = uint32_t(code[0]) | uint32_t(code[1]) << 8 | uint32_t(code[2]) << 16 | uint32_t(code[3]) << 24;
      u.y = uint32_t(code[4]) | uint32_t(code[5]) << 8 | uint32_t(code[6]) << 16 | uint32_t(code[7]) << 24;
      *reinterpret_cast<uint2*>(q.codes[s] + first) = u;
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) {
        if (valid(e)) q.codes[s][first + 32 * e] = code[e];
      }
    }
    if (threadIdx.x % 32 == 0) q.scales[s][block] = absmax;
  });
}

// kBlocks whole quantization blocks from index `block`, contiguous layout: every block's loads first,
// so that one warp iteration keeps kBlocks blocks' loads in flight (the lists may alias, for all the
// compiler knows, so they stay ahead of the stores), then every block's update, then every block's
// requantization. The updates before the requantizations, not block by block: then no 128-bit store
// follows a warp shuffle, whose out-of-line divergence path (BRA.DIV) branches back and, on sm_100,
// made the kernel report see a 14-byte hot loop there.
template <int kBlocks, typename T, int kFlags, typename IO, typename C, typename K>
__device__ __forceinline__ void step_contiguous_blocks(const IO& io, const QuantSlots<T::kSlots>& q,
                                                       const QuantBooks& books, int block, const K& consts) {
  const int first = block * kQuantBlock + int(threadIdx.x) % 32 * kLaneElems;
  LaneBlock<T::kSlots, C> x[kBlocks];
#pragma unroll
  for (int k = 0; k < kBlocks; ++k) load_lane_block<T, kFlags>(io, q, block + k, first + k * kQuantBlock, x[k]);
  C st[kBlocks][T::kSlots][kLaneElems] = {};
#pragma unroll
  for (int k = 0; k < kBlocks; ++k) {
    update_lane_block<T, kFlags>(io, books, x[k], first + k * kQuantBlock, consts, st[k]);
  }
#pragma unroll
  for (int k = 0; k < kBlocks; ++k) {
    requantize_block<true, T, kFlags>(q, books, block + k, first + k * kQuantBlock, 0, st[k]);
  }
}

// One chunk of n elements with int8 states. With `vec` (every list aligned) the whole blocks go
// contiguous, kBlocks at a time per warp iteration (warp w takes blocks kBlocks w, ..., then
// kBlocks (w + 16), ...), and the rest (those past the last whole group, a partial last block)
// strided; else all strided, warp w taking blocks w, w + 16, .... Two loops, not one with a branch:
// the contiguous hot loop holds no scalar path (kernel-report.md). The contiguous loop stays inside
// `if (vec)`: without it, SGD's int8 kernel (flags 4) spilled 4 bytes on sm_100.
template <typename T, int kFlags, int kBlocks, typename IO, typename C, typename K>
__device__ __forceinline__ void step_quant_chunk(const IO& io, const QuantSlots<T::kSlots>& q, const QuantBooks& books,
                                                 int n, bool vec, const K& consts) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int groups = n / (kBlocks * kQuantBlock), blocks = (n + kQuantBlock - 1) / kQuantBlock;
  const int strided_from = vec ? groups * kBlocks : 0;
  if (vec) {
    for (int b = warp; b < groups; b += kWarps) {
      step_contiguous_blocks<kBlocks, T, kFlags, IO, C>(io, q, books, b * kBlocks, consts);
    }
  }
  for (int b = strided_from + warp; b < blocks; b += kWarps) {
    const int first = b * kQuantBlock + lane;
    C st[T::kSlots][kLaneElems] = {};
    update_strided_block<T, kFlags>(io, q, books, b, first, n, consts, st);
    requantize_block<false, T, kFlags>(q, books, b, first, n, st);
  }
}

}  // namespace gradacc::cuda
