// Shared memory between a call's outputs, and between its outputs and inputs (see aliasing.h).
#include "aliasing.h"

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>

#include "stable.h"

namespace gradacc::binding {
namespace {

int64_t element_bytes(DType dtype) {
  switch (dtype) {
    case DType::kFloat64: return 8;
    case DType::kFloat32: return 4;
    case DType::kUInt8: return 1;  // int8 state codes
    default: return 2;  // float16, bfloat16
  }
}

// One tensor's bytes [start, end), and which argument (by its place in the call's order) and item it is.
struct Range {
  uintptr_t start, end;
  uint32_t arg, index;
};

// The Python check's sort key (start, end, argument order, index): ties are broken alike, so both sides
// meet the same pair first.
bool before(const Range& a, const Range& b) {
  return std::tie(a.start, a.end, a.arg, a.index) < std::tie(b.start, b.end, b.arg, b.index);
}

// Sorts `v` by `before`. Long lists take a stable LSD radix sort of the starts, over only the bits where they
// differ (kDigitBits at a time), then order each run of equal starts (an overlap, which the scan refuses) by
// `before`: `v` comes in (argument, index) order, so the result is std::sort's. For 2,000 separate tensors
// (addresses over ~2^20 bytes) that is two passes, the sort under half of std::sort's cost (callgrind: the
// whole memory check 187 -> 163 instructions per (buf, grad) pair).
void sort_ranges(std::vector<Range>& v) {
  constexpr size_t kRadixFrom = 256;  // below it std::sort's n log n undercuts the passes' bucket tables
  constexpr int kDigitBits = 11;
  const size_t n = v.size();
  uintptr_t differ = 0;
  if (n >= kRadixFrom) {
    for (const Range& r : v) differ |= r.start ^ v[0].start;
  }
  if (differ == 0) {  // a short list, or every start the same
    std::sort(v.begin(), v.end(), before);
    return;
  }
  const int low = __builtin_ctzll(uint64_t(differ)), high = 64 - __builtin_clzll(uint64_t(differ));
  std::vector<Range> moved(n);
  std::vector<uint32_t> at(size_t(1) << kDigitBits);
  for (int shift = low; shift < high; shift += kDigitBits) {
    const uintptr_t mask = (uintptr_t(1) << std::min(kDigitBits, high - shift)) - 1;
    std::fill(at.begin(), at.end(), 0);
    for (const Range& r : v) ++at[(r.start >> shift) & mask];
    uint32_t next = 0;
    for (uint32_t& a : at) next += std::exchange(a, next);  // counts -> first slot of each digit
    for (const Range& r : v) moved[at[(r.start >> shift) & mask]++] = r;
    v.swap(moved);
  }
  for (size_t i = 0; i < n;) {  // runs of one start, in (argument, index) order: ordered by end as well
    size_t j = i + 1;
    while (j < n && v[j].start == v[i].start) ++j;
    if (j - i > 1) std::sort(v.begin() + i, v.begin() + j, before);
    i = j;
  }
}

bool range_of(const Span& s, uint32_t arg, uint32_t index, Range& out) {
  if (s.data == nullptr || s.numel == 0) return false;  // no bytes (empty, or meta): nothing to share
  const auto start = reinterpret_cast<uintptr_t>(s.data);
  out = Range{start, start + uintptr_t(s.numel * element_bytes(s.dtype)), arg, index};
  return true;
}

std::string name_of(const MemoryArg& arg, uint32_t index) {
  return arg.list ? std::string(arg.name) + "[" + std::to_string(index) + "]" : std::string(arg.name);
}

[[noreturn]] void shared(const char* op, const std::vector<const MemoryArg*>& args, Range a, Range b) {
  if (std::tie(b.arg, b.index) < std::tie(a.arg, a.index)) std::swap(a, b);  // named in the call's order
  fail(op, ": ", name_of(*args[a.arg], a.index), " and ", name_of(*args[b.arg], b.index),
       " share memory (the same tensor, or overlapping views of one storage); this op writes its outputs in "
       "parallel, so each output may be given once and may not overlap another: pass each tensor once, and views "
       "that do not overlap");
}

}  // namespace

void check_disjoint(const char* op, const std::vector<MemoryArg>& outputs, const std::vector<MemoryArg>& inputs,
                    bool in_place_pairs) {
  std::vector<const MemoryArg*> args;  // outputs, then inputs: the order that names a pair
  size_t count = 0;
  for (const MemoryArg& a : outputs) {
    args.push_back(&a);
    count += a.spans->size();
  }
  std::vector<Range> out;
  out.reserve(count);
  for (uint32_t a = 0; a < args.size(); ++a) {
    if (!args[a]->list) continue;  // check_scalars_disjoint's part
    const std::vector<Span>& spans = *args[a]->spans;
    Range r;
    for (uint32_t i = 0; i < spans.size(); ++i) {
      if (range_of(spans[i], a, i, r)) out.push_back(r);
    }
  }
  if (out.empty()) return;
  // The accumulator's views of one flat buffer come in address order: then no sort.
  if (!std::is_sorted(out.begin(), out.end(), before)) sort_ranges(out);
  const Range* reach = &out[0];  // the output reaching furthest so far
  for (size_t k = 1; k < out.size(); ++k) {
    if (out[k].start < reach->end) shared(op, args, *reach, out[k]);
    if (out[k].end > reach->end) reach = &out[k];
  }
  // Disjoint and sorted, the outputs' ends rise with their starts: the last output that starts before an
  // input ends is the only one that can reach into it.
  const uintptr_t low = out.front().start, high = reach->end;
  const uint32_t first_input = uint32_t(args.size());
  for (const MemoryArg& a : inputs) args.push_back(&a);
  for (uint32_t a = first_input; a < args.size(); ++a) {
    if (!args[a]->list) continue;
    const std::vector<Span>& spans = *args[a]->spans;
    Range in;
    for (uint32_t i = 0; i < spans.size(); ++i) {
      if (!range_of(spans[i], a, i, in) || in.end <= low || in.start >= high) continue;
      const auto after = std::partition_point(out.begin(), out.end(), [&](const Range& o) { return o.start < in.end; });
      if (after == out.begin() || (after - 1)->end <= in.start) continue;
      const Range& hit = *(after - 1);
      const bool own_pair = in_place_pairs && a == first_input && hit.arg == 0 && hit.index == i &&
                            hit.start == in.start && hit.end == in.end &&
                            (*args[0]->spans)[i].dtype == spans[i].dtype;
      if (!own_pair) shared(op, args, hit, in);
    }
  }
}

void check_scalars_disjoint(const char* op, const std::vector<MemoryArg>& outputs,
                            const std::vector<MemoryArg>& inputs) {
  std::vector<const MemoryArg*> args;
  for (const MemoryArg& a : outputs) args.push_back(&a);
  for (const MemoryArg& a : inputs) args.push_back(&a);
  const uint32_t num_outputs = uint32_t(outputs.size());
  for (uint32_t s = 0; s < args.size(); ++s) {
    Range one;
    if (args[s]->list || args[s]->spans->empty() || !range_of((*args[s]->spans)[0], s, 0, one)) continue;
    for (uint32_t a = 0; a < args.size(); ++a) {
      if (a == s || (a >= num_outputs && s >= num_outputs)) continue;  // itself; two inputs may share
      const std::vector<Span>& spans = *args[a]->spans;
      Range other;
      for (uint32_t i = 0; i < spans.size(); ++i) {
        if (range_of(spans[i], a, i, other) && other.start < one.end && one.start < other.end) {
          shared(op, args, one, other);
        }
      }
    }
  }
}

}  // namespace gradacc::binding
