// CPU kernel of the fused optimizer steps (AdamW and SGD), the same element
// math as the CUDA kernel (csrc/kernels/optim_math.cuh).
#pragma once

#include "../kernels/optim_params.h"

namespace gradacc::cpu {

// One step over every param; a no-op (steps included) when *p.found_inf != 0.
void optim_step(const OptimParams& p);

}  // namespace gradacc::cpu
