"""Cheap looks at a loss's autograd graph that catch two migration mistakes before they cost a run.

- A loop migrated with its `loss = loss / accumulation_steps` kept: the
  accumulator divides the window again, so gradients come out N times too
  small and nothing fails. The loss's last op is then a division by N (or a
  multiplication by 1/N) by a constant, which its grad_fn shows.
- A mixed-precision forward run outside micro_step(): it gets no autocast
  and fp32 activations, silently. Autocast leaves low-precision tensors saved
  in the graph (the casted weights and activations); a graph with none ran
  in full precision. Built-in nodes show them as `_saved_*` fields, custom
  autograd.Functions (the fused Linear's node, linear_fusion.py) as
  `saved_tensors`.
"""

from __future__ import annotations

import warnings

import torch

from ..ops.constants import HALF_DTYPES
from .config import GradientAccumulationConfig

_SAVED = ("_saved_self", "_saved_other", "_saved_mat1", "_saved_mat2", "_saved_weight", "_saved_input")
_GRAPH_LIMIT = 20_000  # nodes looked at, at most: a bound on the one-off cost, not a correctness limit


def _constant(node, name: str) -> float | None:
    value = getattr(node, name, None)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.requires_grad:
        return float(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def divided_by(loss: torch.Tensor) -> float | None:
    """N when the loss's last op is `x / N` or `x * (1 / N)` with a constant N > 1, else None."""
    node = loss.grad_fn
    if node is None:
        return None
    name = node.name()
    if name.startswith("DivBackward"):
        divisor = _constant(node, "_saved_other")
        return divisor if divisor is not None and divisor > 1 else None
    if name.startswith("MulBackward"):
        for side in ("_saved_other", "_saved_self"):
            factor = _constant(node, side)
            if factor is not None and 0 < factor < 1:
                return 1.0 / factor
    return None


def ran_in_low_precision(loss: torch.Tensor) -> bool:
    """Whether any tensor saved in the loss's graph is fp16/bf16 (autocast, or a low-precision model)."""
    seen, stack = set(), [loss.grad_fn]
    while stack and len(seen) < _GRAPH_LIMIT:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if any(isinstance(value, torch.Tensor) and value.dtype in HALF_DTYPES for value in _saved(node)):
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def _saved(node) -> tuple:
    """What a graph node saved for backward: a custom autograd.Function's saved_tensors, else the _saved_* fields."""
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        return node.saved_tensors
    return tuple(getattr(node, name, None) for name in _SAVED)


class MigrationChecks:
    """Runs the two checks at backward(), each until it has warned once (the graph walk only once)."""

    def __init__(self, config: GradientAccumulationConfig) -> None:
        self.config = config  # read live: update_config() may change accumulation_steps between windows
        self.check_division = config.loss_normalization != "none"
        self.check_autocast = config.mixed_precision != "no"

    def __call__(self, loss: torch.Tensor, in_micro_step: bool) -> None:
        steps = self.config.accumulation_steps
        if self.check_division and divided_by(loss) == steps > 1:
            self.check_division = False
            warnings.warn(
                f"GradientAccumulator.backward: the loss looks divided by accumulation_steps={steps} already "
                "(its last op divides by that constant), and the accumulator divides the window again, so the "
                "gradients come out that many times too small. Delete the `loss = loss / accumulation_steps` "
                "line, or set loss_normalization='none' if the division is meant",
                UserWarning,
                stacklevel=3,
            )
        if self.check_autocast and not in_micro_step:
            self.check_autocast = False
            if not ran_in_low_precision(loss):
                warnings.warn(
                    "GradientAccumulator.backward: mixed precision is configured but this loss's forward ran "
                    "without autocast (nothing in its graph is fp16/bf16): the forward ran outside "
                    "`with acc.micro_step():`, which is where the accumulator enters autocast. Run forward and "
                    "backward inside micro_step(), or wrap the forward in your own torch.autocast",
                    UserWarning,
                    stacklevel=3,
                )
