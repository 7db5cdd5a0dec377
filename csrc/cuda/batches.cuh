// Cuts span lists into kernel launches (chunking.h) and fills each launch's
// by-value metadata. Host-only and torch-free; shared by every launcher.
#pragma once

#include <array>
#include <vector>

#include "../kernels/multi_tensor.cuh"
#include "../kernels/params.h"

namespace gradacc::cuda {

// Calls launch(meta, blocks) once per batch of plan_launches(): the lists
// run in parallel (same numel per index); lists[0] decides the chunks.
template <int D, typename Launch>
cudaError_t for_each_batch(const std::array<const std::vector<Span>*, D>& lists, Launch&& launch) {
  const std::vector<Span>& spans = *lists[0];
  ListMeta<D> meta;  // only the slots below are read by the kernel
  for (const LaunchBatch& b : plan_launches(spans, ListMeta<D>::kCapacity)) {
    if (b.num_chunks > INT32_MAX) return cudaErrorInvalidValue;  // grid.x and chunk_start are 32-bit
    meta.first_chunk = b.first_chunk;
    int slot = 0;
    int32_t chunk = 0;
    for (int64_t t = b.first_tensor; t < b.end_tensor; ++t) {
      if (spans[t].numel == 0) continue;  // an empty tensor takes no slot and no chunk
      for (int d = 0; d < D; ++d) {
        meta.data[d][slot] = (*lists[d])[t].data;
        meta.dtype[d][slot] = (*lists[d])[t].dtype;
      }
      meta.numel[slot] = spans[t].numel;
      meta.chunk_start[slot] = chunk;
      if constexpr (D == 1) meta.tensor_index[slot] = int32_t(t);
      chunk += int32_t(chunks_of(spans[t].numel));
      ++slot;
    }
    meta.num_tensors = slot;
    launch(meta, unsigned(b.num_chunks));
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace gradacc::cuda
