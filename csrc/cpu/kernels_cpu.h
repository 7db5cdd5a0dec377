// CPU kernels: one parallel pass over memory per op, using the same element
// math as the CUDA kernels (csrc/kernels/element_math.cuh). Each is compiled
// once per ISA and dispatched at runtime (isa.h).
#pragma once

#include "../kernels/params.h"
#include "isa.h"

namespace gradacc::cpu {

GRADACC_CPU_KERNEL(accumulate, AccumulateParams)
GRADACC_CPU_KERNEL(norm, NormParams)
GRADACC_CPU_KERNEL(scale, ScaleParams)

}  // namespace gradacc::cpu
