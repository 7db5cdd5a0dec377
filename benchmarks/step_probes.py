"""Per-contender figures of benchmarks/fused_step.py beyond time: peak step memory and the bytes each one moves."""

from __future__ import annotations

from collections.abc import Callable

import torch
from memory_probes import LiveBytes

# Bytes per param each contender's passes move (fp32 params/buffers/state, bf16 micro-step grads). The floor
# is 38: grad read 2, buffer read+write 8, the step reads param, buffer, exp_avg, exp_avg_sq (16), writes 12.
ADD_NORM = 2 + 8  # accumulate_final_: add, inf check and sum of squares in one pass (unscale rides in grad_mult)
TORCH_TAIL = (2 + 8) + 8 + 4 + 8  # _foreach_add_, unscale (read+write), norm (read), clip (read+write)
STEP = 16 + 12  # one fused AdamW pass
# AdamW(foreach) on CPU: mul_ (decay) 8, lerp_ 12, mul_ 8, addcmul_ 12, sqrt 8, div_ 8, add_ (eps) 8, addcdiv_ 16
FOREACH_ADAMW = 8 + 12 + 8 + 12 + 8 + 8 + 8 + 16
BYTES_PER_PARAM: dict[str, int | None] = {
    "gradacc accumulate_final_ + adamw_step_": ADD_NORM + STEP,
    "gradacc accumulate_final_ + clip + torch fused AdamW": ADD_NORM + 8 + STEP,  # + one unscale-and-clip pass
    "torch eager (foreach)": TORCH_TAIL + FOREACH_ADAMW,
    "torch fused AdamW + foreach clip": TORCH_TAIL + STEP,
    "torch.compile (eager tail + step)": None,  # inductor decides the passes; the floor is the honest yardstick
}
FLOOR_BYTES_PER_PARAM = ADD_NORM + STEP


def peak_step_bytes(fn: Callable[[], None], device: torch.device) -> int:
    """Most bytes one warm step allocates above what it started with (its transients)."""
    with LiveBytes(device) as live:
        fn()
    return live.peak
