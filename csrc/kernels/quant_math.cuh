// Element math of the low-bit optimizer states (issue 30, LOWBIT_SPEC.md section 3), shared by the CPU
// kernel (g++), the CUDA kernel (nvcc) and the host emulation; gradacc_ext/ops/reference_optim.py does
// the same in PyTorch. Torch-free.
//
// int8 storage: each block of kQuantBlock consecutive elements of a state tensor (counted from the
// tensor's element 0; the last block may be partial) holds uint8 codes and one float32 absmax. A code
// decodes to map[code] * absmax; a new value y (divided by the block's new absmax) encodes to the number
// of midpoints strictly below it. The maps are quant_maps.h's, passed as pointers so that the CUDA kernel
// can read its own device copy.
//
// bf16 storage: the new value is stored with stochastic rounding (optim_math.cuh's stochastic_bf16),
// from random bits drawn at positions disjoint from the params' own.
#pragma once

#include <cstdint>

#include "optim_math.cuh"
#include "quant_maps.h"

namespace gradacc {

// The host tables of a state slot's code book: signed (momenta) or unsigned (second moments), as the
// traits' kStateSigned say. Host only: device code reads its own copy of the tables.
inline const float* quant_codes(bool is_signed) { return is_signed ? kSignedCodes : kUnsignedCodes; }
inline const float* quant_midpoints(bool is_signed) { return is_signed ? kSignedMidpoints : kUnsignedMidpoints; }

// The value of `code` in a block whose absmax is `absmax` (0 while the block is fresh).
GRADACC_HD float quant_decode(uint8_t code, float absmax, const float* codes) { return mul_rn(codes[code], absmax); }

// The running absmax (from 0) of a block with one more value: NaN-propagating (a NaN anywhere gives a NaN),
// by element_math.cuh's bit-pattern maximum, which vectorises.
GRADACC_HD float absmax_nan(float acc, float x) { return max_abs_nan(acc, abs_f(x)); }

// A new value relative to its block's new absmax (0 for an all-zero block).
GRADACC_HD float quant_relative(float x, float absmax) { return absmax == 0.0f ? 0.0f : div_rn(x, absmax); }

// The code of a relative value y: the number of the 255 ascending midpoints strictly below y, by an
// 8-step branch-free binary search (c + step - 1 never passes 254), which a compiler may vectorise with
// gathers. A NaN compares below nothing: code 0.
GRADACC_HD uint8_t quant_encode(float y, const float* midpoints) {
  int c = 0;
#if defined(__CUDA_ARCH__)  // the device pass only: the host compiler rejects the pragma (-Werror)
#pragma unroll
#endif
  for (int step = 128; step > 0; step >>= 1) c += midpoints[c + step - 1] < y ? step : 0;
  return uint8_t(c);
}

// The 32 random bits of state slot `slot` at the element's `position` (the params' own position, which
// draws splitmix64(stream + position)): the slot number in the top byte puts every slot's draws in a
// position range of its own, disjoint from the params'.
GRADACC_HD uint32_t state_random_bits(uint64_t stream, uint64_t position, int slot) {
  return uint32_t(splitmix64(stream + position + (uint64_t(slot + 1) << 56)) >> 32);
}

}  // namespace gradacc
