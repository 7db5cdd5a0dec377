// Host side of the CUDA kernels: cut the lists into launches (chunking.h),
// fill each launch's by-value metadata, launch. Torch-free.
#include <array>
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
struct NormWorkspace {
  NormAcc* partials;
  int32_t* chunk_tensor;
};

NormWorkspace norm_workspace(void* workspace, int64_t chunks) {
  NormAcc* partials = static_cast<NormAcc*>(workspace);
  return NormWorkspace{partials, reinterpret_cast<int32_t*>(partials + chunks)};
}

// Pass 2 of the norm: the total, and `num_per_tensor` per-tensor norms.
cudaError_t launch_finalize(const NormWorkspace& ws, int64_t chunks, NormKind kind, double p, float* total_out,
                            float* per_tensor_out, size_t num_per_tensor, cudaStream_t stream) {
  if (num_per_tensor >= size_t(INT32_MAX)) return cudaErrorInvalidValue;
  norm_finalize_kernel<<<unsigned(1 + num_per_tensor), kBlockThreads, 0, stream>>>(
      ws.partials, ws.chunk_tensor, chunks, kind, p, total_out, per_tensor_out);
  return cudaGetLastError();
}

}  // namespace

size_t accumulate_workspace_bytes(const AccumulateParams& p) {
  return p.final_step ? size_t(total_chunks(p.bufs)) * sizeof(NormAcc) : 0;
}

cudaError_t launch_accumulate(const AccumulateParams& p, void* workspace, cudaStream_t stream) {
  const AccumulateArgs args{p.alpha_ptr, p.inv_scale_ptr, p.found_inf, static_cast<NormAcc*>(workspace), p.alpha};
  const auto kernel = p.final_step ? (p.assign ? accumulate_kernel<true, true> : accumulate_kernel<true, false>)
                                   : (p.assign ? accumulate_kernel<false, true> : accumulate_kernel<false, false>);
  const cudaError_t err = for_each_batch<2>({&p.bufs, &p.grads}, [&](const ListMeta<2>& meta, unsigned blocks) {
    kernel<<<blocks, kBlockThreads, 0, stream>>>(meta, args);
  });
  if (err != cudaSuccess || !p.final_step) return err;
  // The final step's norm only needs the total: no chunk -> tensor map.
  return launch_finalize(NormWorkspace{args.partials, nullptr}, total_chunks(p.bufs), p.norm_kind, 2.0, p.norm_out,
                         nullptr, 0, stream);
}

size_t norm_workspace_bytes(const NormParams& p) {
  return size_t(total_chunks(p.tensors)) * (sizeof(NormAcc) + sizeof(int32_t));
}

cudaError_t launch_norm(const NormParams& p, void* workspace, cudaStream_t stream) {
  const int64_t chunks = total_chunks(p.tensors);
  const NormWorkspace ws = norm_workspace(workspace, chunks);
  const NormArgs args{ws.partials, ws.chunk_tensor, p.p, p.norm_kind};
  const bool fast = p.norm_kind == NormKind::kL2 || p.norm_kind == NormKind::kInf;
  const auto kernel = fast ? norm_kernel<true> : norm_kernel<false>;
  const cudaError_t err = for_each_batch<1>({&p.tensors}, [&](const ListMeta<1>& meta, unsigned blocks) {
    kernel<<<blocks, kBlockThreads, 0, stream>>>(meta, args);
  });
  if (err != cudaSuccess) return err;
  return launch_finalize(ws, chunks, p.norm_kind, p.p, p.total_out, p.per_tensor_out,
                         p.per_tensor_out ? p.tensors.size() : 0, stream);
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
