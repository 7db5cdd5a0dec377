// Host side of the CUDA kernels: cut the lists into launches (chunking.h),
// fill each launch's by-value metadata, launch. Torch-free.
#include <array>
#include <type_traits>
#include <vector>

#include "../kernels/accumulate.cuh"
#include "../kernels/norm.cuh"
#include "../kernels/scale.cuh"
#include "batches.cuh"
#include "launch.h"

namespace gradacc::cuda {
namespace {

int64_t total_chunks(const std::vector<Span>& spans) {
  int64_t n = 0;
  for (const Span& s : spans) n += chunks_of(s.numel);
  return n;
}

// Workspace of the norm: partials[chunks], then chunk_tensor[chunks].
template <typename A>
struct NormWorkspace {
  NormAccT<A>* partials;
  int32_t* chunk_tensor;
};

template <typename A>
NormWorkspace<A> norm_workspace(void* workspace, int64_t chunks) {
  NormAccT<A>* partials = static_cast<NormAccT<A>*>(workspace);
  return NormWorkspace<A>{partials, reinterpret_cast<int32_t*>(partials + chunks)};
}

// Pass 2 of the norm: the total, and `num_per_tensor` per-tensor norms.
template <typename A>
cudaError_t launch_finalize(const NormWorkspace<A>& ws, int64_t chunks, NormKind kind, double p, A* total_out,
                            A* per_tensor_out, size_t num_per_tensor, cudaStream_t stream, bool add_to_total = false) {
  if (num_per_tensor >= size_t(INT32_MAX)) return cudaErrorInvalidValue;
  norm_finalize_kernel<A><<<unsigned(1 + num_per_tensor), kBlockThreads, 0, stream>>>(
      ws.partials, ws.chunk_tensor, chunks, kind, p, total_out, per_tensor_out, add_to_total);
  return cudaGetLastError();
}

template <typename A>
cudaError_t launch_norm_in(const NormParams& p, void* workspace, cudaStream_t stream) {
  const int64_t chunks = total_chunks(p.tensors);
  const NormWorkspace<A> ws = norm_workspace<A>(workspace, chunks);
  const NormArgs<A> args{ws.partials, ws.chunk_tensor, p.p, p.norm_kind};
  // The fast path is fp32's; a double accumulator always takes the generic one.
  auto kernel = norm_kernel<A, false>;
  if constexpr (std::is_same_v<A, float>) {
    if (p.norm_kind == NormKind::kL2 || p.norm_kind == NormKind::kInf) kernel = norm_kernel<float, true>;
  }
  const cudaError_t err = for_each_batch<1>({&p.tensors}, [&](const ListMeta<1>& meta, unsigned blocks) {
    kernel<<<blocks, kBlockThreads, 0, stream>>>(meta, args);
  });
  if (err != cudaSuccess) return err;
  return launch_finalize(ws, chunks, p.norm_kind, p.p, static_cast<A*>(p.total_out),
                         static_cast<A*>(p.per_tensor_out), p.per_tensor_out ? p.tensors.size() : 0, stream);
}

}  // namespace

size_t accumulate_workspace_bytes(const AccumulateParams& p) {
  return p.final_step ? size_t(total_chunks(p.bufs)) * sizeof(NormAcc) : 0;
}

cudaError_t launch_accumulate(const AccumulateParams& p, void* workspace, cudaStream_t stream) {
  const AccumulateArgs args{p.alpha_ptr, p.found_inf, static_cast<NormAcc*>(workspace), p.alpha};
  const auto kernel = p.final_step ? (p.assign ? accumulate_kernel<true, true> : accumulate_kernel<true, false>)
                                   : (p.assign ? accumulate_kernel<false, true> : accumulate_kernel<false, false>);
  const cudaError_t err = for_each_batch<2>({&p.bufs, &p.grads}, [&](const ListMeta<2>& meta, unsigned blocks) {
    kernel<<<blocks, kBlockThreads, 0, stream>>>(meta, args);
  });
  if (err != cudaSuccess || !p.final_step) return err;
  // The final step's partial only needs the total: no chunk -> tensor map; added into *norm_acc.
  return launch_finalize(NormWorkspace<float>{args.partials, nullptr}, total_chunks(p.bufs), p.norm_kind, 2.0,
                         p.norm_acc, static_cast<float*>(nullptr), 0, stream, true);
}

size_t norm_workspace_bytes(const NormParams& p) {
  const size_t acc = p.wide ? sizeof(NormAccT<double>) : sizeof(NormAcc);
  return size_t(total_chunks(p.tensors)) * (acc + sizeof(int32_t));
}

cudaError_t launch_norm(const NormParams& p, void* workspace, cudaStream_t stream) {
  return p.wide ? launch_norm_in<double>(p, workspace, stream) : launch_norm_in<float>(p, workspace, stream);
}

cudaError_t launch_scale(const ScaleParams& p, cudaStream_t stream) {
  const ScaleArgs args{p.inv_scale_ptr, p.found_inf, p.norm_ptr, p.max_norm, p.eps, p.clip_value, p.norm_dtype};
  const auto kernel = p.mode == ScaleMode::kUnscale    ? scale_kernel<ScaleMode::kUnscale>
                      : p.mode == ScaleMode::kClipNorm ? scale_kernel<ScaleMode::kClipNorm>
                                                       : scale_kernel<ScaleMode::kClipValue>;
  return for_each_batch<1>({&p.tensors}, [&](const ListMeta<1>& meta, unsigned blocks) {
    kernel<<<blocks, kBlockThreads, 0, stream>>>(meta, args);
  });
}

}  // namespace gradacc::cuda
