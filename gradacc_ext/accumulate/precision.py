"""The values of GradientAccumulationConfig.mixed_precision, and the other spellings users bring for them.

Read by the config (each spelling becomes its canonical value) and by the guides' use_amp/amp_dtype
resolution (guide_spellings.py), which compares a guide's two precision fields as the config will read them.
"""

from __future__ import annotations

from typing import Literal

import torch

MixedPrecision = Literal["no", "fp16", "bf16"]

MIXED_PRECISION = ("no", "fp16", "bf16")
# Other spellings users bring (torch dtypes, Lightning/nanoGPT names), read as the canonical ones.
MIXED_PRECISION_SPELLINGS = {
    torch.float32: "no",
    "float32": "no",
    torch.bfloat16: "bf16",
    "bfloat16": "bf16",
    torch.float16: "fp16",
    "float16": "fp16",
}
