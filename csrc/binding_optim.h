// Binding layer of the fused optimizer steps: defines every optimizer op of
// kernels/optim_traits.cuh, reads its arguments by the schema's names, does
// every tensor and option check, then hands the raw-pointer OptimParams to a
// kernel. A bad argument throws a c10::Error naming it before any kernel
// runs, so nothing is written on an error path.
#pragma once

#include <c10/core/Device.h>
#include <torch/library.h>

#include "kernels/optim_params.h"

namespace gradacc::binding {

// Runs one checked step on the params' device (never called without params).
using OptimRunner = void (*)(const OptimParams& p, c10::Device device);

// The schemas of every optimizer op (ops.cpp's TORCH_LIBRARY).
void define_optim_ops(torch::Library& m);

// Registers every optimizer op with `run` as the kernel of m's dispatch key.
void impl_optim_ops(torch::Library& m, OptimRunner run);

}  // namespace gradacc::binding
