"""The one place that writes param.grad for the accumulator (DDP's overlap strategy hands DDP its own views).

param.grad is where autograd leaves a gradient and where an optimizer reads one. The accumulator
takes gradients off it as they arrive (hooks.py), shows the optimizer the window's sums there
(buffers.py), lends autograd a buffer view there between micro-steps (grad_views.py) and clears it
after a failed backward or a step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def take(param: torch.Tensor) -> torch.Tensor:
    """param.grad, leaving None behind (autograd writes a new gradient next time)."""
    grad, param.grad = param.grad, None
    return grad


def show(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """param.grad = grad (a buffer view, a param-dtype copy, or None)."""
    param.grad = grad


def clear(params: Iterable[torch.Tensor]) -> None:
    for p in params:
        p.grad = None
