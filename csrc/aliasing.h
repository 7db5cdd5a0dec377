// Which arguments of one call may share memory: the binding's side of gradacc_ext/ops/_aliasing.py.
//
// The kernels write their outputs in parallel (CPU chunks, CUDA blocks) while they read the inputs, so
// an output that overlaps another output, or an input, is a race: accumulate_([a, b], [b, a]) gave a
// different result on most runs with 2 threads. Every op refuses it, naming the pair, with the message
// the Python check raises, before anything is written. The one exception is an op's in-place pair:
// where the op allows it (accumulate_, accumulate_final_: bufs[i] += alpha * bufs[i] is elementwise
// and equals the reference), an input that is exactly its own paired output (same bytes, same dtype).
//
// Cost: the outputs' byte ranges, sorted once (no sort when they come in address order, as the
// accumulator's views of one flat buffer do), swept once; then each input is one comparison with the
// outputs' hull, or one binary search in the sorted outputs where it falls inside: O(n log n), and O(n)
// for the accumulator, whose gradients live outside its buffer.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/params.h"

namespace gradacc::binding {

// One argument of the call: its name, its tensors' spans, and whether it is a list (items are named
// name[i]) or one tensor (named name).
struct MemoryArg {
  const char* name;
  const std::vector<Span>* spans;
  bool list = true;
};

// A one-tensor argument (a scale, flag or norm) for check_disjoint; `span` must outlive the call.
inline MemoryArg scalar_arg(const char* name, const std::vector<Span>& span) { return MemoryArg{name, &span, false}; }

// A checked one-element float32 tensor's span, or none (an absent optional argument).
inline std::vector<Span> scalar_span(const float* data) {
  if (data == nullptr) return {};
  return {Span{const_cast<float*>(data), 1, DType::kFloat32}};
}

// Raises (the message of ops/_aliasing.py's SHARED, naming the pair) when an item of an output list shares
// memory with another output item or with an item of an input list. `in_place_pairs`: inputs[0][i] may be
// exactly outputs[0][i]. Arguments are compared in the order given (outputs, then inputs), as the Python
// check does, so both name the same pair. Made where the lists have been read, before the pair checks (as
// the Python side makes it first), so a list given twice is named as such.
void check_disjoint(const char* op, const std::vector<MemoryArg>& outputs, const std::vector<MemoryArg>& inputs,
                    bool in_place_pairs = false);

// The one-tensor arguments' part, made last, once they are checked: each one-tensor argument (outputs first)
// against every tensor of every other argument but two inputs; a few per call, so a plain scan.
void check_scalars_disjoint(const char* op, const std::vector<MemoryArg>& outputs,
                            const std::vector<MemoryArg>& inputs);

}  // namespace gradacc::binding
