"""gradacc_ext: fused gradient-accumulation kernels and a drop-in accumulator.

Ops (gradacc_ext.ops, also re-exported here) run on the fused CUDA kernels for
CUDA tensors, the C++ CPU kernels for CPU tensors, and the pure-PyTorch
reference when the extension is not built (or with backend="torch").
"""

from __future__ import annotations

from .accumulate import AdaptiveGradientAccumulator, GradientAccumulationConfig, GradientAccumulator, StepInfo
from .distributed.failures import PeerOutOfMemoryError
from .ops import (
    accumulate_,
    accumulate_final_,
    build_info,
    clip_by_norm_,
    clip_by_value_,
    clip_grad_norm_,
    extension_has_cuda,
    extension_loaded,
    global_norm,
    register_fake_kernels,
    resolve_backend,
    unscale_,
)
from .planning import AccumulationPlan, plan_accumulation, probe_max_micro_batch_size, scale_lr_linear, scale_lr_sqrt

__version__ = "0.1.0"

if extension_loaded():
    register_fake_kernels()

__all__ = [
    "AccumulationPlan",
    "AdaptiveGradientAccumulator",
    "GradientAccumulationConfig",
    "GradientAccumulator",
    "PeerOutOfMemoryError",
    "StepInfo",
    "__version__",
    "accumulate_",
    "accumulate_final_",
    "build_info",
    "clip_by_norm_",
    "clip_by_value_",
    "clip_grad_norm_",
    "extension_has_cuda",
    "extension_loaded",
    "global_norm",
    "plan_accumulation",
    "probe_max_micro_batch_size",
    "resolve_backend",
    "scale_lr_linear",
    "scale_lr_sqrt",
    "unscale_",
]
