// CPU kernel of the fused optimizer steps (every optimizer of
// csrc/kernels/optim_traits.cuh), the same element math as the CUDA kernel,
// compiled once per ISA and dispatched at runtime (isa.h).
#pragma once

#include "../kernels/optim_params.h"
#include "isa.h"

namespace gradacc::cpu {

// One step over every param; a no-op (steps included) when *p.found_inf != 0.
GRADACC_CPU_KERNEL(optim_step, OptimParams)

}  // namespace gradacc::cpu
