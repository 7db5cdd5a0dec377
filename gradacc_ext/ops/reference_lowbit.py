"""The int8 state storage of the reference (reference_optim.py): blockwise decode and encode in PyTorch.

The same algorithm as csrc/kernels/quant_math.cuh (LOWBIT_SPEC.md section 3): a state tensor's elements
form blocks of quant_maps.BLOCK consecutive elements (from element 0; the last may be partial), each with
one float32 absmax. A code decodes to ``codes[code] * absmax``; a new value is divided by its block's new
absmax (NaN-propagating; an all-zero block stays 0) and encoded as the number of midpoints strictly below
it (a NaN: 0). In float32 it is the kernels' arithmetic, rounding for rounding; in float64 (``dtype``) it is
the oracle of the same algorithm, each table value widened exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant_maps import BLOCK, code_values, midpoints


def _per_element(absmax: torch.Tensor, numel: int) -> torch.Tensor:
    """Each element's block absmax, flat."""
    return absmax.repeat_interleave(BLOCK)[:numel]


def decode(codes: torch.Tensor, absmax: torch.Tensor, signed: bool, dtype: torch.dtype) -> torch.Tensor:
    """The values of uint8 `codes` (any shape) whose blocks have the float32 `absmax`es, in `dtype`."""
    table = code_values(signed).to(device=codes.device, dtype=dtype)
    flat = table[codes.reshape(-1).long()] * _per_element(absmax.to(dtype), codes.numel())
    return flat.view(codes.shape)


def encode(values: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes of `values`' shape, float32 absmax per block) of new state values (float32 or float64)."""
    flat = values.reshape(-1)
    numel = flat.numel()
    blocks = F.pad(flat.abs(), (0, -numel % BLOCK)).view(-1, BLOCK)
    absmax = blocks.amax(dim=1)  # NaN-propagating, as the kernels' bit-pattern maximum
    scale = _per_element(absmax, numel)
    y = torch.where(scale == 0, torch.zeros_like(flat), flat / scale)
    mids = midpoints(signed).to(device=flat.device, dtype=flat.dtype)
    codes = torch.searchsorted(mids, y, side="left")  # the number of midpoints strictly below y
    codes = torch.where(torch.isnan(y), torch.zeros_like(codes), codes)
    return codes.to(torch.uint8).view(values.shape), absmax.to(torch.float32)
