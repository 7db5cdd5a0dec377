// CUDA kernel of the fused optimizer steps, one template over every
// optimizer of optim_traits.cuh. Torch-free.
//
// One block per chunk, like every other multi-tensor kernel; the element
// math is the optimizer's update(), the same as the CPU kernel's. fp32/16-bit chunks
// whose pointers are all 16-byte aligned take vector accesses (apex
// multi_tensor_axpby style) in groups of kOptimVec<T>, the rest (and fp64)
// go element by element; the chunk's last n % kOptimVec<T> elements are the
// scalar tail. Step counts are read
// here and incremented afterwards by step_increment_kernel, so no block ever
// sees another's increment.
#pragma once

#include "multi_tensor.cuh"
#include "optim_dispatch.cuh"

namespace gradacc::cuda {

// Slots of the launch metadata: param, grad, the state lists (kMaxStateSlots), the
// master weights and the step count (null pointers where unused).
enum OptimSlot : int { kParam = 0, kGrad, kState0, kMaster = kState0 + kMaxStateSlots, kStep, kOptimDepth };

struct OptimArgs {
  OptimScalars s;
  const float* lr_ptr;
  const float* grad_mult_ptr;
  const float* found_inf;
  int64_t seed;
  ParamMode mode;
};
static_assert(sizeof(ListMeta<kOptimDepth>) + sizeof(OptimArgs) <= kParamLimit, "optimizer kernel parameters");

// Elements per thread per vector step of optimizer T. 4 for SGD and Lion:
// 16 bytes of each fp32 list, 8 of a 16-bit one; groups of 8 had them spill
// on sm_100. AdamW keeps 8: in groups of 4 ptxas capped it at 64 registers
// and spilled around the division and square-root slow paths; in groups of
// 8 it takes 84-98 registers, one 512-thread block per SM, whose hot loop
// still keeps >= 48 KB of loads in flight per SM (docs/kernel-report.md).
template <typename T>
constexpr int kOptimVec = std::is_same_v<T, AdamW> ? kVec : 4;

// Calls fn(Width<W>{}, i) over the chunk: groups of kW with vector
// accesses when `vec`, else (and always for fp64) one element per call. An
// element's update does not depend on the others, so the two paths need not
// visit the elements in the same order, and the scalar path is not unrolled:
// each update holds division and square-root slow paths (subroutine calls)
// that would otherwise be kW times in every loop iteration.
template <int kW, bool kCanVec, typename F>
__device__ __forceinline__ void for_each_element_group(int n, bool vec, F&& fn) {
  if constexpr (kCanVec) {
    if (vec) {
      for_each_group<kW>(n, true, fn);
      return;
    }
  }
  for_each_element(n, fn);
}

template <typename T>
__device__ __forceinline__ T* slot_ptr(const ListMeta<kOptimDepth>& meta, int slot, int which, int64_t first) {
  void* p = meta.data[which][slot];
  return p == nullptr ? nullptr : static_cast<T*>(p) + first;
}

// Element k's state values of a group: s[slot] is st[slot][k].
template <typename C, int kSlots, int W>
struct Column {
  C (&st)[kSlots][W];
  int k;
  __device__ __forceinline__ C& operator[](int slot) const { return st[slot][k]; }
};

// One step of optimizer T (optim_traits.cuh) in its compile-time variant kFlags.
template <typename T, int kFlags>
__global__ void __launch_bounds__(kBlockThreads)
    optim_kernel(const __grid_constant__ ListMeta<kOptimDepth> meta, const OptimArgs args) {
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) return;  // uniform: the whole step is skipped
  const BlockChunk c = block_chunk(meta);
  const float* step = static_cast<const float*>(meta.data[kStep][c.slot]);
  const double done = step != nullptr ? double(*step) : 0.0;
  const double lr = args.lr_ptr != nullptr ? args.s.lr * double(*args.lr_ptr) : args.s.lr;
  const double mult = args.grad_mult_ptr != nullptr ? double(*args.grad_mult_ptr) : 1.0;
  const uint64_t stream = rounding_stream(args.seed, float(done + 1.0));
  const uint64_t position = uint64_t(meta.first_chunk + int64_t(blockIdx.x)) * uint64_t(kChunkElems);

  dispatch_param_grad(meta.dtype[kParam][c.slot], meta.dtype[kGrad][c.slot], [&](auto param_tag, auto grad_tag) {
    using P = decltype(param_tag);
    using G = decltype(grad_tag);
    using C = ComputeOf<P>;
    P* param = slot_ptr<P>(meta, c.slot, kParam, c.first_elem);
    const G* grad = slot_ptr<const G>(meta, c.slot, kGrad, c.first_elem);
    float* master = slot_ptr<float>(meta, c.slot, kMaster, c.first_elem);
    C* state[T::kSlots];
    bool vec = aligned16(param) && aligned16(grad) && aligned16(master);  // a null pointer counts as aligned
#pragma unroll
    for (int s = 0; s < T::kSlots; ++s) {
      state[s] = T::uses(s, kFlags) ? slot_ptr<C>(meta, c.slot, kState0 + s, c.first_elem) : nullptr;
      vec = vec && aligned16(state[s]);
    }
    dispatch_mode<P>(args.mode, [&](auto mode_tag) {
      constexpr ParamMode M = decltype(mode_tag)::value;
      const auto consts = T::template consts<C>(args.s, lr, done, mult);
      for_each_element_group<kOptimVec<T>, !std::is_same_v<C, double>>(c.n, vec, [&](auto width, int i) {
        constexpr int W = decltype(width)::value;
        C p[W], st[T::kSlots][W] = {};  // the state slots this variant uses
        G g[W];
        load_raw<W>(grad + i, g);
        if constexpr (M == ParamMode::kMaster) {
          load_raw<W>(master + i, p);
        } else {
          P raw[W];
          load_raw<W>(param + i, raw);
#pragma unroll
          for (int k = 0; k < W; ++k) p[k] = load_as<C>(raw[k]);
        }
#pragma unroll
        for (int s = 0; s < T::kSlots; ++s) {
          if (T::uses(s, kFlags)) load_raw<W>(state[s] + i, st[s]);
        }
        P out[W];
#pragma unroll
        for (int k = 0; k < W; ++k) {
          p[k] = T::template update<kFlags>(p[k], load_as<C>(g[k]), Column<C, T::kSlots, W>{st, k}, consts);
          out[k] = store_param<P, M>(p[k], stream, position + uint64_t(i + k));
        }
#pragma unroll
        for (int s = 0; s < T::kSlots; ++s) {
          if (T::uses(s, kFlags)) store_raw<W>(state[s] + i, st[s]);
        }
        if constexpr (M == ParamMode::kMaster) store_raw<W>(master + i, p);
        store_raw<W>(param + i, out);
      });
    });
  });
}

// The step counts of one launch, incremented after the update kernels.
constexpr int kStepBatch = int((kParamLimit - 64) / sizeof(float*));
struct StepList {
  float* ptr[kStepBatch];
  const float* found_inf;
  int count;
};

__global__ void step_increment_kernel(const __grid_constant__ StepList list) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= list.count || (list.found_inf != nullptr && *list.found_inf != 0.0f)) return;
  *list.ptr[i] = add_rn(*list.ptr[i], 1.0f);
}

}  // namespace gradacc::cuda
