"""The accumulator's read side: counters, the loss scale, norm history, loggers and the guides' stats dicts.

A mixin of GradientAccumulator, kept apart from the micro-step machinery in accumulator.py. It reads the
collaborators that GradientAccumulator._attach() creates (the stepper, stats, StatsReport and Window); a read's
only effect is resolving a deferred fused step (one host read). accumulate_gradients, the guides' entry point,
is backward() plus the stats dict they read, so it lives here beside the other stats.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .reports import check_same_objects
from .stats import StepInfo


class AccumulatorObserving:
    """Observing a GradientAccumulator: counters, norms, loggers and the guides' stats entry points."""

    @property
    def last_step_skipped(self) -> bool | None:
        """Whether the last closed window's step was skipped (inf/NaN); None before the first. May sync."""
        self._stepper.resolve()
        return self._stepper.last_skipped

    @property
    def optimizer_steps(self) -> int:
        self._stepper.resolve()
        return self.stats.optimizer_steps

    @property
    def skipped_steps(self) -> int:
        self._stepper.resolve()
        return self.stats.skipped_steps

    @property
    def micro_steps_in_window(self) -> int:
        return self._window.micro

    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (a host read), or None without fp16."""
        return self._report.scale_value()

    def grad_norm_history(self) -> torch.Tensor:
        """Pre-clip global grad norms of the last windows (CPU float32, oldest first; one host read)."""
        return self.stats.grad_norm_history()

    def add_callback(self, callback: Callable[[StepInfo], None]):
        """Subscribe a logger: callback(StepInfo) after every window; returns a handle with remove()."""
        return self.stats.add_callback(callback)

    def reset_stats(self) -> None:
        self._stepper.resolve()
        self.stats.reset()

    def accumulate_gradients(
        self,
        loss: torch.Tensor,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: torch.amp.GradScaler | None = None,
        *,
        num_items: int | torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """Compatibility entry point of the guides: backward(loss, num_items) plus a stats dict.

        model/optimizer/scaler may be passed as in the guides' call shape; each
        must be the object this accumulator was built with (any disabled scaler
        is accepted: no loss scaling). gradacc_ext.compat.GradientAccumulator
        also takes seed 001's order and attaches on the first call.
        """
        if isinstance(loss, torch.nn.Module):
            raise TypeError(
                "GradientAccumulator.accumulate_gradients: the first argument is a model; this is the (loss, model, "
                "optimizer, scaler) order. gradacc_ext.compat.GradientAccumulator takes both orders"
            )
        own_scaler = self._loss_scale.scaler if self._loss_scale is not None else None
        if scaler is not None and own_scaler is None and not scaler.is_enabled():
            scaler = None
        check_same_objects(
            model=(model, self.module), optimizer=(optimizer, self.optimizer), scaler=(scaler, own_scaler)
        )
        closed = self.backward(loss, num_items)
        return self._report.after_backward(closed, loss, self._last_backpropagated)

    def get_accumulation_stats(self) -> dict[str, Any]:
        """Every statistic as host values (reads the device-side norm history: one sync)."""
        self._stepper.resolve()
        return self._report.all_stats()
