"""Values every layer shares (ops, optimizers, the accumulator, the clipping utils), defined once."""

from __future__ import annotations

import torch

DEFAULT_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: clip coefficient = max_norm / (norm + eps)
HALF_DTYPES = (torch.float16, torch.bfloat16)  # 16-bit floats: fp32 accumulation and optimizer state for them
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # what every single-list op takes


def state_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """The optimizer state's dtype for a param: float64 for float64 params, float32 otherwise."""
    return torch.float64 if param_dtype == torch.float64 else torch.float32
