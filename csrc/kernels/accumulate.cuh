// bufs[i] = (assign ? 0 : bufs[i]) + alpha * grads[i], and a bucket of the window's last fold
// (found-inf flag, norm partial per chunk, added into the running partial). Torch-free.
// Same element math, in the same order, as cpu::accumulate.
#pragma once

#include "dispatch.cuh"
#include "multi_tensor.cuh"

namespace gradacc::cuda {

struct AccumulateArgs {
  const float* alpha_ptr;  // optional device scalar, multiplies alpha
  float* found_inf;        // final step
  NormAcc* partials;       // final step: one per global chunk
  float alpha;
};
static_assert(sizeof(ListMeta<2>) + sizeof(AccumulateArgs) <= kParamLimit, "accumulate kernel parameters");

// kAssign is a template parameter so the assign path never reads the buffer.
// Three resident blocks (<= 40 registers): ptxas otherwise squeezes this
// kernel into 32 registers and spills on sm_80.
template <bool kFinal, bool kAssign>
__global__ void __launch_bounds__(kBlockThreads, 3)
    accumulate_kernel(const __grid_constant__ ListMeta<2> meta, const AccumulateArgs args) {
  const BlockChunk c = block_chunk(meta);
  const float alpha = args.alpha_ptr ? mul_rn(args.alpha, *args.alpha_ptr) : args.alpha;
  NormAcc acc = norm_acc_init();
  bool bad = false;

  dispatch_buf_grad(meta.dtype[0][c.slot], meta.dtype[1][c.slot], [&](auto buf_tag, auto grad_tag) {
    using B = decltype(buf_tag);
    using G = decltype(grad_tag);
    B* buf = static_cast<B*>(meta.data[0][c.slot]) + c.first_elem;
    const G* grad = static_cast<const G*>(meta.data[1][c.slot]) + c.first_elem;
    for_each_group(c.n, aligned16(buf) && aligned16(grad), [&](auto width, int i) {
      constexpr int W = decltype(width)::value;
      B b[W] = {};
      G g[W];
      if constexpr (!kAssign) load_raw<W>(buf + i, b);
      load_raw<W>(grad + i, g);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const float gv = Elem<G>::load(g[k]);
        b[k] = Elem<B>::store(accumulate_value(Elem<B>::load(b[k]), gv, alpha, kAssign));
        if constexpr (kFinal) {
          // Statistics describe the value as stored, like the CPU kernel.
          const float s = Elem<B>::load(b[k]);
          bad |= !is_finite(s);
          acc = norm_acc_add(acc, s);
        }
      }
      store_raw<W>(buf + i, b);
    });
  });

  if constexpr (kFinal) {
    // Uniform barrier: every thread gets here (no early exit above).
    if (__syncthreads_or(bad) && threadIdx.x == 0) *args.found_inf = 1.0f;  // racy 0 -> 1, benign
    const NormAcc total = block_reduce(acc);
    if (threadIdx.x == 0) args.partials[meta.first_chunk + blockIdx.x] = total;
  }
}

}  // namespace gradacc::cuda
