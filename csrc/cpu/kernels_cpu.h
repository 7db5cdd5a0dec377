// CPU kernels: one parallel pass over memory per op, using the same element
// math as the CUDA kernels (csrc/kernels/element_math.cuh).
#pragma once

#include "../kernels/params.h"

namespace gradacc::cpu {

void accumulate(const AccumulateParams& p);
void norm(const NormParams& p);
void scale(const ScaleParams& p);

}  // namespace gradacc::cpu
