// Binding layer of the fused optimizer steps: defines every optimizer op of
// kernels/optim_traits.cuh, reads its arguments by the schema's names, does
// every tensor and option check, then hands the raw-pointer OptimParams to a
// kernel. A bad argument throws (GRADACC_CHECK) a message naming it before any
// kernel runs, so nothing is written on an error path.
#pragma once

#include <cstdint>

#include "kernels/optim_params.h"
#include "stable.h"

namespace gradacc::binding {

// Runs one checked step on the params' device (never called without params).
using OptimRunner = void (*)(const OptimParams& p, const Device& device);

// The schemas of every optimizer op (ops.cpp's STABLE_TORCH_LIBRARY).
void define_optim_ops(torch::stable::detail::StableLibrary& m);

// One call of optimizer `kind` from a stable boxed stack: read every argument
// by its name in the schema, check, run, in that order.
void run_step(int kind, OptimRunner run, StableIValue* stack, uint64_t num_args);

// The CPU kernel of a step (cpu/optim_cpu.cpp).
void run_cpu_step(const OptimParams& p, const Device& device);

// A stable boxed kernel carries no state and sees no schema, so each
// (runner, optimizer) pair is its own function.
template <OptimRunner Run, int Kind>
void boxed_step(StableIValue* stack, uint64_t num_args, uint64_t /*num_outputs*/) {
  run_step(Kind, Run, stack, num_args);
}

// Registers every optimizer op with `Run` as the kernel of m's dispatch key.
template <OptimRunner Run>
void impl_optim_ops(torch::stable::detail::StableLibrary& m) {
  for_each_optimizer([&](auto traits) {
    using T = decltype(traits);
    m.impl(T::kName, &boxed_step<Run, kKindOf<T>>);
  });
}

}  // namespace gradacc::binding
