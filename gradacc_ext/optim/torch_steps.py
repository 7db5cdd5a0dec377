"""torch.optim.AdamW / Adam / SGD stepped by gradacc's fused ops, on torch's own state (fused_step.py).

Each adapter steps one param group from given gradients with one adamw_step_ / sgd_step_ call. The
state stays in torch's format (created lazily as torch creates it), so optimizer.state_dict() is
interchangeable with optimizer.step()'s: a run may switch between the two at any window.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..ops import sgd_step_
from .adamw import step_adam_group
from .shards import on_local_shards

# (group, params, grads, grad_mult, found_inf) -> None
GroupStep = Callable[[dict, list, list, "torch.Tensor | None", "torch.Tensor | None"], None]


class TorchAdamStep:
    """torch.optim.AdamW and Adam (decoupled weight decay, or none) through adamw_step_."""

    def __init__(self, optimizer: torch.optim.Optimizer, backend: str) -> None:
        self.optimizer, self.backend = optimizer, backend

    def __call__(self, group: dict, params: list, grads: list, grad_mult, found_inf) -> None:
        states = [self.optimizer.state[p] for p in params]
        for p, state in zip(params, states, strict=True):
            if "step" not in state:  # torch's lazy state, as Adam._init_group creates it
                state["step"] = torch.tensor(0.0, dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"] and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] = _step_tensor(state["step"], p)
        max_sqs = [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else []
        step_adam_group(
            group,
            params,
            grads,
            states,
            [s["step"] for s in states],
            max_sqs,
            lr=_lr(group, params[0]),
            maximize=bool(group["maximize"]),
            grad_mult=grad_mult,
            found_inf=found_inf,
            backend=self.backend,
        )


class TorchSGDStep:
    """torch.optim.SGD through sgd_step_; the step counts it has no slot for are kept here."""

    def __init__(self, optimizer: torch.optim.Optimizer, backend: str) -> None:
        self.optimizer, self.backend = optimizer, backend
        self._steps: dict[torch.Tensor, tuple[torch.Tensor | None, torch.Tensor]] = {}

    def __call__(self, group: dict, params: list, grads: list, grad_mult, found_inf) -> None:
        buffers, steps = [], []
        if group["momentum"] != 0:
            for p in params:
                state = self.optimizer.state[p]
                buf = state.get("momentum_buffer")
                known, step = self._steps.get(p, (None, None))
                if step is None or known is not buf:
                    # torch.optim.SGD has no step count: a buffer it made (or loaded) is past its first step.
                    step = torch.tensor(0.0 if buf is None else 1.0, dtype=torch.float32, device=p.device)
                if buf is None:
                    buf = state["momentum_buffer"] = torch.zeros_like(p)  # the first real step overwrites it
                self._steps[p] = (buf, step)
                buffers.append(buf)
                steps.append(step)
        on_local_shards(sgd_step_)(
            params,
            grads,
            lr=_lr(group, params[0]),
            momentum=float(group["momentum"]),
            dampening=float(group["dampening"]),
            weight_decay=float(group["weight_decay"]),
            nesterov=bool(group["nesterov"]),
            momentum_buffers=buffers,
            steps=steps,
            maximize=bool(group["maximize"]),
            grad_mult=grad_mult,
            found_inf=found_inf,
            backend=self.backend,
        )


# The torch optimizers a fused step takes (exact types: a subclass may change step()).
TORCH_STEPS: dict[type[torch.optim.Optimizer], Callable[[torch.optim.Optimizer, str], GroupStep]] = {
    torch.optim.AdamW: TorchAdamStep,
    torch.optim.Adam: TorchAdamStep,
    torch.optim.SGD: TorchSGDStep,
}


def _lr(group: dict, param: torch.Tensor) -> float | torch.Tensor:
    lr = group["lr"]
    return lr.to(param.device, torch.float32) if isinstance(lr, torch.Tensor) else float(lr)


def _step_tensor(step: torch.Tensor | float, param: torch.Tensor) -> torch.Tensor:
    """torch's step count as the op takes it: float32 on the param's device (as torch's fused Adam keeps it)."""
    if isinstance(step, torch.Tensor) and step.dtype == torch.float32 and step.device == param.device:
        return step
    value = step if isinstance(step, torch.Tensor) else torch.tensor(float(step))
    return value.to(device=param.device, dtype=torch.float32).reshape(())
