"""Combining partial norms into one: of several devices, of per-tensor norms, of shards on several ranks.

For any p, the p-norm of a concatenation is the p-norm of its parts' p-norms: ||x|| = (sum ||x_i||^p)^(1/p),
the max for p = inf, and for p = 0 (torch's count of nonzero parts) the count of nonzero part norms.
combine_norms does it for norms held here; across ranks, partial_norm gives what a SUM (MAX for inf)
all-reduce adds up and norm_from_partial turns the reduced value back into the norm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def combine_norms(norms: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of everything whose part norms are `norms` (tensors of one or more norms, on one device)."""
    if len(norms) == 1 and norms[0].numel() == 1 and norm_type != 0:
        return norms[0].reshape(())  # one part: its norm, unrounded
    return torch.linalg.vector_norm(torch.cat([n.reshape(-1) for n in norms]), norm_type)


def partial_norm(norm: torch.Tensor, norm_type: float) -> torch.Tensor:
    """What ranks add up (or take the max of, for inf) to combine their norms: norm**p."""
    if math.isinf(norm_type):
        return norm
    if norm_type == 0:
        return (norm != 0).to(norm.dtype)  # a part counts when it holds a nonzero
    return norm * norm if norm_type == 2 else norm.pow(norm_type)


def norm_from_partial(total: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The combined norm from the reduced partial_norm values."""
    if math.isinf(norm_type) or norm_type == 0:
        return total
    return total.sqrt() if norm_type == 2 else total.pow(1.0 / norm_type)
