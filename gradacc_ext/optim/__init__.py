"""Fused optimizers: torch.optim.AdamW and SGD, and Lion, one pass over params, grads and state.

Drop-in for torch's (constructor, param groups, state_dict, LR schedulers, GradScaler), and
they step 16-bit params from float32 grads (accumulation buffers) with optional float32
master weights or stochastic rounding. See gradacc_ext.ops.adamw_step_ / sgd_step_ / lion_step_.
fused_step_for(optimizer, params, backend) gives GradientAccumulator's window its one fused step over
the accumulation buffers, for these and for torch's AdamW / Adam / SGD (fused_step.py).
"""

from ._fused import DEFAULT_PARAM_MODE, PARAM_MODES
from .adamw import FusedAdamW
from .fused_step import FusedStep, fused_step_for
from .lion import FusedLion
from .sgd import FusedSGD

__all__ = ["DEFAULT_PARAM_MODE", "PARAM_MODES", "FusedAdamW", "FusedLion", "FusedSGD", "FusedStep", "fused_step_for"]
