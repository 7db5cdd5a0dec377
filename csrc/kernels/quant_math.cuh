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

// The value of `code` in a block whose absmax is `absmax` (0 while the block is fresh).
GRADACC_HD float quant_decode(uint8_t code, float absmax, const float* codes) { return mul_rn(codes[code], absmax); }

// The running absmax (from 0) of a block with one more value: NaN-propagating (a NaN anywhere gives a NaN),
// by element_math.cuh's bit-pattern maximum, which vectorises.
GRADACC_HD float absmax_nan(float acc, float x) { return max_abs_nan(acc, abs_f(x)); }

// A new value relative to its block's new absmax (0 for an all-zero block).
GRADACC_HD float quant_relative(float x, float absmax) { return absmax == 0.0f ? 0.0f : div_rn(x, absmax); }

// The encoder's tables of a state slot's code book (quant_maps.h): the first code of each bucket and the
// midpoints padded with +inf. Host only, as quant_codes.
inline const uint8_t* quant_encode_first(bool is_signed) { return is_signed ? kSignedEncodeFirst : kUnsignedEncodeFirst; }
inline const float* quant_encode_midpoints(bool is_signed) {
  return is_signed ? kSignedEncodeMidpoints : kUnsignedEncodeMidpoints;
}

// The code of a relative value y: the number of the 255 ascending midpoints strictly below y. A bucket
// table, indexed by y's sign and its magnitude's exponent and top mantissa bits (clamped: every midpoint
// lies inside), gives the bucket's lowest code; kQuantEncodeSteps branch-free comparisons (the generator's
// bound on the midpoints inside one bucket) finish it. Padding with +inf keeps c at 255. It replaces an
// 8-step binary search of dependent loads (callgrind: about a third of the instructions); the codes are
// the same for every float32 (tests/ops/test_quant_encode.py). A NaN compares below nothing: code 0.
GRADACC_HD uint8_t quant_encode(float y, const uint8_t* first, const float* midpoints_inf) {
  const uint32_t bits = float_bits(y);
  uint32_t mag = bits & 0x7FFFFFFFu;
  mag = mag < kQuantEncodeLowBits ? kQuantEncodeLowBits : mag;
  mag = mag > kQuantEncodeHighBits ? kQuantEncodeHighBits : mag;
  int c = first[(bits >> 31) * kQuantEncodeBuckets + ((mag - kQuantEncodeLowBits) >> kQuantEncodeShift)];
#if defined(__CUDA_ARCH__)  // the device pass only: the host compiler rejects the pragma (-Werror)
#pragma unroll
#endif
  for (int k = 0; k < kQuantEncodeSteps; ++k) c += midpoints_inf[c] < y ? 1 : 0;
  return is_nan(y) ? uint8_t(0) : uint8_t(c);
}

// The same code by an 8-step branch-free binary search over the 255 midpoints (c + step - 1 never passes
// 254): the CUDA kernel's encoder, which keeps only the midpoints in shared memory (4 KB of books per
// block; the bucket tables would add 6 KB). Equal to quant_encode for every float32 (tests/ops/
// test_quant_encode.py; the emulation tests hold the CUDA kernel's codes equal to the reference's). NaN: code 0.
GRADACC_HD uint8_t quant_encode_search(float y, const float* midpoints) {
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
