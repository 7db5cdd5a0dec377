// CUDA kernel of the fused optimizer steps, one template over every
// optimizer of optim_traits.cuh and every state storage (LOWBIT_SPEC.md).
// Torch-free.
//
// One block per chunk, like every other multi-tensor kernel; the element
// math is the optimizer's update(), the same as the CPU kernel's. With fp32
// or bf16 states (step_elements), fp32/16-bit chunks whose pointers are all
// 16-byte aligned take vector accesses (apex multi_tensor_axpby style) in
// groups of kOptimVec<T>, the rest (and fp64) go element by element; the
// chunk's last n % kOptimVec<T> elements are the scalar tail. int8 states
// go by quantization block (optim_quant.cuh). Step counts are read
// here and incremented afterwards by step_increment_kernel, so no block ever
// sees another's increment.
#pragma once

#include "optim_quant.cuh"

namespace gradacc::cuda {

// Slots of the launch metadata: param, grad, the state lists (kMaxStateSlots), the
// master weights and the step count (null pointers where unused); int8 states
// add their scales lists (kQuantOptimDepth), so fp32 and bf16 keep 7 lists' capacity.
enum OptimSlot : int {
  kParam = 0,
  kGrad,
  kState0,
  kMaster = kState0 + kMaxStateSlots,
  kStep,
  kOptimDepth,
  kScales0 = kOptimDepth,
  kQuantOptimDepth = kScales0 + kMaxStateSlots
};
constexpr int optim_depth(StateStorage s) { return s == StateStorage::kInt8 ? kQuantOptimDepth : kOptimDepth; }
template <StateStorage S>
using OptimMeta = ListMeta<optim_depth(S)>;

struct OptimArgs {
  OptimScalars s;
  const float* lr_ptr;
  const float* grad_mult_ptr;
  const float* found_inf;
  int64_t seed;
  ParamMode mode;
};
static_assert(sizeof(ListMeta<kOptimDepth>) + sizeof(OptimArgs) <= kParamLimit, "optimizer kernel parameters");
static_assert(sizeof(ListMeta<kQuantOptimDepth>) + sizeof(OptimArgs) <= kParamLimit, "int8 optimizer kernel parameters");

// Elements per thread per vector step of optimizer T. 4 for SGD and Lion:
// 16 bytes of each fp32 list, 8 of a 16-bit one; groups of 8 had them spill
// on sm_100. AdamW keeps 8: in groups of 4 ptxas capped it at 64 registers
// and spilled around the division and square-root slow paths; in groups of
// 8 it takes 84-98 registers, one 512-thread block per SM, whose hot loop
// still keeps >= 48 KB of loads in flight per SM (docs/kernel-report.md).
template <typename T>
constexpr int kOptimVec = std::is_same_v<T, AdamW> ? kVec : 4;

// Resident blocks per SM that ptxas must allow (__launch_bounds__'s second argument; 0 leaves it
// unset, to ptxas's own heuristic). The fp32-state kernels keep the heuristic (a floor of 2 moved
// SGD from 32 to 42 registers on sm_100). Left to it, the bf16-state AdamW and the int8-state Lion
// were capped at 64 registers and spilled: AdamW's low-bit kernels allow one block (84-98
// registers; their hot loops keep >= 32 KB of loads in flight), SGD's and Lion's two (<= 64).
template <typename T, StateStorage S>
constexpr int kOptimMinBlocks = S == StateStorage::kFloat ? 0 : std::is_same_v<T, AdamW> ? 1 : 2;

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

template <typename T, int D>
__device__ __forceinline__ T* slot_ptr(const ListMeta<D>& meta, int slot, int which, int64_t first) {
  void* p = meta.data[which][slot];
  return p == nullptr ? nullptr : static_cast<T*>(p) + first;
}

// One chunk of optimizer T in variant kFlags with fp32 or bf16 states (S); state[s] is null for a
// slot the variant does not use.
template <typename T, int kFlags, StateStorage S, typename IO, typename C, typename K>
__device__ __forceinline__ void step_elements(const IO& io, StateElem<S, C>* const (&state)[T::kSlots], int n,
                                              bool vec, const K& consts) {
  for_each_element_group<kOptimVec<T>, !std::is_same_v<C, double>>(n, vec, [&](auto width, int i) {
    constexpr int W = decltype(width)::value;
    C p[W], g[W], st[T::kSlots][W] = {};  // the state slots this variant uses
    io.template load<W>(i, p, g);
#pragma unroll
    for (int s = 0; s < T::kSlots; ++s) {
      if (T::uses(s, kFlags)) load_state<S>(state[s] + i, st[s]);
    }
#pragma unroll
    for (int k = 0; k < W; ++k) p[k] = T::template update<kFlags>(p[k], g[k], Column<C, T::kSlots, W>{st, k}, consts);
#pragma unroll
    for (int s = 0; s < T::kSlots; ++s) {
      if (T::uses(s, kFlags)) store_state<S>(state[s] + i, st[s], s, io.stream, io.position + uint64_t(i));
    }
    io.template store<W>(i, p);
  });
}

// Quantization blocks one warp takes per iteration of the int8 contiguous loop (optim_quant.cuh's
// step_quant_chunk). The one-block-per-SM kernel (AdamW) takes two with 16-bit grads: one block's
// loads (8 16-bit params and grads, two slots' codes and scales: 56 bytes per lane) kept 28 KB in
// flight per SM, under the kernel report's 32 KB floor (docs/kernel-report.md); two keep 56 KB.
template <typename T, typename G>
constexpr int kQuantBlocksPerStep = kOptimMinBlocks<T, StateStorage::kInt8> == 1 && kIs16Bit<G> ? 2 : 1;

// One step of optimizer T (optim_traits.cuh) in its compile-time variant kFlags, states stored as S.
// S other than kFloat is instantiated for float compute only: fp64 params keep fp64 states (the
// binding refuses the rest), so their dispatch branch is empty there.
template <typename T, int kFlags, StateStorage S>
__global__ void __launch_bounds__(kBlockThreads, kOptimMinBlocks<T, S>)
    optim_kernel(const __grid_constant__ OptimMeta<S> meta, const OptimArgs args) {
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) return;  // uniform: the whole step is skipped
  constexpr bool kQuant = S == StateStorage::kInt8;
  __shared__ std::conditional_t<kQuant, QuantBooks, NoBooks> books;  // 4 KB for int8 only
  if constexpr (kQuant) load_quant_books<T, kFlags>(books);
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
    if constexpr (S == StateStorage::kFloat || std::is_same_v<C, float>) {
      P* param = slot_ptr<P>(meta, c.slot, kParam, c.first_elem);
      const G* grad = slot_ptr<const G>(meta, c.slot, kGrad, c.first_elem);
      float* master = slot_ptr<float>(meta, c.slot, kMaster, c.first_elem);
      bool vec = aligned16(param) && aligned16(grad) && aligned16(master);  // a null pointer counts as aligned
      dispatch_mode<P>(args.mode, [&](auto mode_tag) {
        constexpr ParamMode M = decltype(mode_tag)::value;
        const ParamLists<P, G, C, M> io{param, grad, master, stream, position};
        const auto consts = T::template consts<C>(args.s, lr, done, mult);
        if constexpr (kQuant) {
          QuantSlots<T::kSlots> q{};
          for_used_slots<T, kFlags>([&](auto slot) {
            constexpr int s = decltype(slot)::value;
            q.codes[s] = slot_ptr<uint8_t>(meta, c.slot, kState0 + s, c.first_elem);
            q.scales[s] = slot_ptr<float>(meta, c.slot, kScales0 + s, c.first_elem / kQuantBlock);
            vec = vec && (reinterpret_cast<uintptr_t>(q.codes[s]) & 7u) == 0;  // 8 codes: one 64-bit access
          });
          step_quant_chunk<T, kFlags, kQuantBlocksPerStep<T, G>, decltype(io), C>(io, q, books, c.n, vec, consts);
        } else {
          StateElem<S, C>* state[T::kSlots];
#pragma unroll
          for (int s = 0; s < T::kSlots; ++s) {
            state[s] = T::uses(s, kFlags) ? slot_ptr<StateElem<S, C>>(meta, c.slot, kState0 + s, c.first_elem) : nullptr;
            vec = vec && aligned16(state[s]);
          }
          step_elements<T, kFlags, S, decltype(io), C>(io, state, c.n, vec, consts);
        }
      });
    }
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
