"""The 8-bit code books of the blockwise-quantized optimizer states (``state_dtype="int8"``).

Dynamic tree quantization (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2022): a code
stands for a value in [-1, 1] (signed map: momenta) or [0, 1] (unsigned map: second moments), relative to its
block's absolute maximum. The values are spread over seven decades: decade ``i`` (0..6) holds the midpoints of
an even grid over [0.1, 1] scaled by ``10**(i - 6)``, with ``2**i`` points per sign (signed) or ``2**(i+1)``
(unsigned, which spends the sign bit on resolution), so small values keep their relative precision; 0 and 1 are
codes of their own. 254 + 2 = 256 codes, sorted ascending: a code's order is its value's order.

A value y (already divided by its block's absmax) is encoded as the number of midpoints strictly below it
(``MIDPOINTS``, float32, each the float64 mean of two neighbours rounded once): the nearest code, a tie going
to the lower one. Both tables are float32; ``csrc/kernels/quant_maps.h`` holds the same numbers, written by
``scripts/gen_quant_maps.py`` (tests/ops/test_quant_maps.py holds them equal), for the CPU and CUDA kernels.
"""

from __future__ import annotations

import functools

import torch

DECADES = 7
BLOCK = 256  # elements per quantization block, each with one float32 absmax
NAMES = ("dynamic_signed", "dynamic_unsigned")  # the maps' names, as a state_dict records them


def _grid_means(points: int) -> list[float]:
    """The `points` midpoints of an even grid of points + 1 values over [0.1, 1]."""
    edges = [0.1 + 0.9 * k / points for k in range(points + 1)]
    return [(a + b) / 2.0 for a, b in zip(edges, edges[1:], strict=False)]


@functools.cache
def code_values(signed: bool) -> torch.Tensor:
    """The 256 values of the signed or unsigned map, float32, ascending."""
    values = [0.0, 1.0]
    for decade in range(DECADES):
        scale = 10.0 ** (decade - (DECADES - 1))
        means = [scale * m for m in _grid_means(2**decade if signed else 2 ** (decade + 1))]
        values += means + ([-m for m in means] if signed else [])
    assert len(values) == 256, len(values)
    return torch.tensor(sorted(values), dtype=torch.float64).to(torch.float32)


@functools.cache
def midpoints(signed: bool) -> torch.Tensor:
    """The 255 float32 decision points between neighbouring codes (float64 means, rounded once)."""
    v = code_values(signed).double()
    return ((v[:-1] + v[1:]) / 2.0).to(torch.float32)


def map_name(signed: bool) -> str:
    return NAMES[0] if signed else NAMES[1]


def zero_code(signed: bool) -> int:
    """The code of 0.0 (any code decodes to 0 while its block's absmax is 0, as a fresh state's is)."""
    return int((code_values(signed) == 0).nonzero()[0])


# The encoder's bucket table (quant_math.cuh's quant_encode): a float32 y's magnitude bits, clamped to
# [ENCODE_LOW_BITS, ENCODE_HIGH_BITS] (2**-24 up to just below 2: every midpoint's magnitude lies inside),
# shifted right by ENCODE_SHIFT (keeping the exponent and the top 6 mantissa bits), pick a bucket; the table
# holds the lowest code of any value in the bucket, and at most `steps` midpoints lie inside any bucket.
ENCODE_SHIFT = 17
ENCODE_LOW_BITS = (127 - 24) << 23
ENCODE_HIGH_BITS = (128 << 23) - 1
ENCODE_BUCKETS = ((ENCODE_HIGH_BITS - ENCODE_LOW_BITS) >> ENCODE_SHIFT) + 1  # per sign


def encode(y: torch.Tensor, signed: bool) -> torch.Tensor:
    """The code of each float32 y: the number of midpoints strictly below it (NaN: 0), int64."""
    codes = torch.searchsorted(midpoints(signed), y.to(torch.float32).contiguous())
    return torch.where(y.isnan(), 0, codes)


def _bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


@functools.cache
def encode_buckets(signed: bool) -> tuple[torch.Tensor, int]:
    """The encoder's table (uint8, 2 * ENCODE_BUCKETS entries: positive buckets, then negative ones) and its
    number of steps: the most codes any bucket spans beyond its first (every non-NaN float32 checked, by the
    ends of its bucket: the code is monotone in y)."""
    b = torch.arange(ENCODE_BUCKETS, dtype=torch.int64)
    low = torch.where(b == 0, 0, ENCODE_LOW_BITS + (b << ENCODE_SHIFT))
    high = torch.where(b == ENCODE_BUCKETS - 1, 0x7F800000, ENCODE_LOW_BITS + ((b + 1) << ENCODE_SHIFT) - 1)
    low_f, high_f = _bits_to_float(low), _bits_to_float(high)
    first = torch.cat([encode(low_f, signed), encode(-high_f, signed)])
    last = torch.cat([encode(high_f, signed), encode(-low_f, signed)])
    return first.to(torch.uint8), int((last - first).max())
