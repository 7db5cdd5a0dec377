// How a tensor list is cut into fixed-size chunks, shared by the CPU kernels
// and the CUDA launchers. Host-only and torch-free.
//
// A chunk is the unit of work of one CUDA block (and one CPU task), and the
// unit of the norm's partial sums. Because chunk boundaries depend only on
// the tensor sizes, the norm's reduction order is fixed: results are
// bit-identical from run to run whatever the thread count.
#pragma once

#include <cstdint>
#include <vector>

namespace gradacc {

constexpr int64_t kChunkElems = 65536;

inline int64_t chunks_of(int64_t numel) { return (numel + kChunkElems - 1) / kChunkElems; }

// Where chunk number `c` (global, over the whole list) lives.
struct ChunkRef {
  int32_t tensor;       // index into the list
  int64_t first_elem;   // offset of the chunk inside that tensor
};

// Every chunk of the list, in list order; empty tensors contribute none.
template <typename SpanVec>
std::vector<ChunkRef> list_chunks(const SpanVec& spans) {
  std::vector<ChunkRef> chunks;
  size_t total = 0;  // counted first: growing the vector item by item reallocates and copies it log n times
  for (size_t t = 0; t < spans.size(); ++t) total += size_t(chunks_of(spans[t].numel));
  chunks.reserve(total);
  for (size_t t = 0; t < spans.size(); ++t) {
    const int64_t n = chunks_of(spans[t].numel);
    for (int64_t c = 0; c < n; ++c) chunks.push_back({int32_t(t), c * kChunkElems});
  }
  return chunks;
}

// One kernel launch covers tensors [first_tensor, end_tensor) of the list,
// which own global chunks [first_chunk, first_chunk + num_chunks).
struct LaunchBatch {
  int64_t first_tensor;
  int64_t end_tensor;
  int64_t first_chunk;
  int64_t num_chunks;
};

// Packs the list into as few launches as the per-launch metadata allows:
// at most `max_tensors` non-empty tensors per launch. Empty tensors take no
// slot and no chunk.
template <typename SpanVec>
std::vector<LaunchBatch> plan_launches(const SpanVec& spans, int64_t max_tensors) {
  std::vector<LaunchBatch> batches;
  LaunchBatch cur{0, 0, 0, 0};
  int64_t slots = 0;
  for (size_t t = 0; t < spans.size(); ++t) {
    const int64_t n = chunks_of(spans[t].numel);
    if (n > 0 && slots == max_tensors) {
      batches.push_back(cur);
      cur = LaunchBatch{int64_t(t), int64_t(t), cur.first_chunk + cur.num_chunks, 0};
      slots = 0;
    }
    cur.end_tensor = int64_t(t) + 1;
    cur.num_chunks += n;
    slots += n > 0 ? 1 : 0;
  }
  if (cur.num_chunks > 0) batches.push_back(cur);
  return batches;
}

}  // namespace gradacc
