"""Fused optimizers: torch.optim.AdamW and SGD, and Lion, one pass over params, grads and state.

Drop-in for torch's (constructor, param groups, state_dict, LR schedulers, GradScaler), and
they step 16-bit params from float32 grads (accumulation buffers) with optional float32
master weights or stochastic rounding. See gradacc_ext.ops.adamw_step_ / sgd_step_ / lion_step_.
fused_step_for(optimizer, params, backend) gives GradientAccumulator's window its one fused step over
the accumulation buffers, for these and for torch's AdamW / Adam / SGD (fused_step.py).
Their state_dtype ("fp32", "bf16", "int8": state_storage.py) keeps the state in low-memory storages;
to_torch_state_dict / from_torch_state_dict (state_convert.py) convert a state_dict to and from torch's fp32 form.
"""

from ._fused import DEFAULT_PARAM_MODE, PARAM_MODES
from .adamw import FusedAdamW
from .fused_step import FusedStep, fused_step_for
from .lion import FusedLion
from .sgd import FusedSGD
from .state_convert import from_torch_state_dict, to_torch_state_dict
from .state_storage import DEFAULT_INT8_MIN_NUMEL, STATE_DTYPES

__all__ = [
    "DEFAULT_INT8_MIN_NUMEL",
    "DEFAULT_PARAM_MODE",
    "PARAM_MODES",
    "STATE_DTYPES",
    "FusedAdamW",
    "FusedLion",
    "FusedSGD",
    "FusedStep",
    "from_torch_state_dict",
    "fused_step_for",
    "to_torch_state_dict",
]
