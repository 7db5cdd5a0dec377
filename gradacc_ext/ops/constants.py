"""Values every layer shares (ops, optimizers, the accumulator, the clipping utils), defined once."""

from __future__ import annotations

import torch

DEFAULT_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: clip coefficient = max_norm / (norm + eps)
HALF_DTYPES = (torch.float16, torch.bfloat16)  # 16-bit floats: fp32 accumulation and optimizer state for them
