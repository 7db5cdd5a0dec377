"""One fused optimizer step over gradients the caller holds: what GradientAccumulator's window ends in.

fused_step_for(optimizer, params, backend) returns a FusedStep, or the reason (one line) why this
optimizer cannot take it. A FusedStep steps every param group once from `grads` (param -> gradient,
e.g. the accumulator's float32 buffers) with a device multiplier `grad_mult` (loss-scale inverse x
normaliser x clip coefficient) and `found_inf` (nonzero: nothing is written); it never syncs the host.

Supported: gradacc's fused optimizers, every subclass of _fused.FusedOptimizer (their own `step_grads`:
a new one is found by its base class, not listed anywhere), and torch.optim.AdamW, Adam and SGD through
the adapters of torch_steps.py, which keep torch's state format.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.optim.optimizer as optimizer_module

from ..ops.constants import HALF_DTYPES
from ._fused import FusedOptimizer
from .torch_steps import TORCH_STEPS

Grads = dict[torch.Tensor, torch.Tensor]


class FusedStep(Protocol):
    """What fused_step_for returns: step(grads, grad_mult, found_inf) steps every param group once.

    grads maps each param to its gradient (params absent from it are not stepped); grad_mult (a device
    scalar or None) multiplies every gradient as it is read; a nonzero found_inf writes nothing. No host sync.
    """

    calls: int  # fused op calls made (observable: tests and stats)

    def __call__(self, grads: Grads, grad_mult: torch.Tensor | None, found_inf: torch.Tensor | None) -> None: ...


class _StepGrads:
    """A fused optimizer's own step_grads: one call steps every group."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.calls = 0

    def __call__(self, grads: Grads, grad_mult: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        _record_step(self.optimizer)
        self.optimizer.step_grads(grads, grad_mult, found_inf)
        self.calls += 1


class _TorchStep:
    """torch's AdamW / Adam / SGD: one op call per param group, on torch's own state tensors."""

    def __init__(self, optimizer: torch.optim.Optimizer, backend: str) -> None:
        self.optimizer = optimizer
        self.run = TORCH_STEPS[type(optimizer)](optimizer, backend)
        self.calls = 0

    @torch.no_grad()
    def __call__(self, grads: Grads, grad_mult: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        _record_step(self.optimizer)
        for group in self.optimizer.param_groups:
            params = [p for p in group["params"] if p in grads]
            if params:
                self.run(group, params, [grads[p] for p in params], grad_mult, found_inf)
                self.calls += 1


def _record_step(optimizer: torch.optim.Optimizer) -> None:
    # What torch's LR schedulers' wrapper of optimizer.step() records: a step was taken, so a
    # scheduler step after it is in the right order (no "lr_scheduler.step() before" warning).
    optimizer._opt_called = True


def fused_step_for(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], backend: str
) -> FusedStep | str:
    """The fused step of `optimizer` over `params` (the ops' `backend` for torch's optimizers), or why not."""
    why = unsupported_reason(optimizer, params)
    if why is not None:
        return why
    if isinstance(optimizer, FusedOptimizer):
        return _StepGrads(optimizer)
    return _TorchStep(optimizer, backend)


def unsupported_reason(optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter]) -> str | None:
    """Why `optimizer` cannot take the fused step over `params` (None: it can)."""
    name = type(optimizer).__name__
    # The type first: a wrapper (Accelerate's AcceleratedOptimizer) never ran Optimizer.__init__, so it has
    # no step-hook dicts to read; its own step() is called instead.
    if not isinstance(optimizer, FusedOptimizer) and type(optimizer) not in TORCH_STEPS:
        fused = ", ".join(sorted(cls.__name__ for cls in _subclasses(FusedOptimizer)))
        return f"{name} is not {fused}, or torch.optim.AdamW / Adam / SGD"
    hooks = optimizer_module._global_optimizer_pre_hooks, optimizer_module._global_optimizer_post_hooks
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks or any(hooks):
        return "optimizer step hooks are registered (the fused pass does not call optimizer.step())"
    if isinstance(optimizer, FusedOptimizer):
        # A fused optimizer clips only when built with max_grad_norm, which a FusedStep never applies (the
        # caller clips by its own norm).
        if optimizer.max_grad_norm is not None:
            return f"{name}(max_grad_norm=...) clips inside its own step; set the config's max_grad_norm instead"
        return None
    low = sorted({str(p.dtype) for p in params if p.dtype in HALF_DTYPES})
    if low:
        return f"torch.optim.{name} keeps its state in the param dtype ({', '.join(low)}); use gradacc's Fused{name}"
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            return f"torch.optim.{name}(differentiable=True)"
        adam_l2 = type(optimizer) is torch.optim.Adam and not group.get("decoupled_weight_decay", False)
        if adam_l2 and group["weight_decay"] != 0:
            return "torch.optim.Adam with weight_decay adds it to the gradient (L2), not decoupled (AdamW)"
    return None


def _subclasses(cls: type) -> list[type]:
    """Every class derived from `cls`, at any depth."""
    return [sub for direct in cls.__subclasses__() for sub in (direct, *_subclasses(direct))]
