"""The accumulator's read side: counters, the loss scale, norm history, the window's state and loggers.

A mixin of GradientAccumulator, kept apart from the micro-step machinery in accumulator.py. It reads the
collaborators that GradientAccumulator.__init__() creates (the stepper, stats, loss scale and Window); a
read's only effect is resolving a deferred fused step (one host read).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .stats import StepInfo, WindowState


class AccumulatorObserving:
    """Observing a GradientAccumulator: counters, norms, the window's state and loggers."""

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
        return None if self._loss_scale is None else float(self._loss_scale.tensor(self.device).item())

    def window_state(self) -> WindowState:
        """The open window's counters and the last window's device tensors, without a host read."""
        return WindowState(
            micro_steps=self._window.micro,
            grad_norm=self._end.norm,
            loss_scale=self._loss_scale.tensor(self.device) if self._loss_scale is not None else None,
            scaler=self._loss_scale.scaler if self._loss_scale is not None else None,
            last_loss=self._last_backpropagated,
        )

    def grad_norm_history(self) -> torch.Tensor:
        """Pre-clip global grad norms of the last windows (CPU float32, oldest first; one host read)."""
        return self.stats.grad_norm_history()

    def add_callback(self, callback: Callable[[StepInfo], None]):
        """Subscribe a logger: callback(StepInfo) after every window; returns a handle with remove()."""
        return self.stats.add_callback(callback)

    def reset_stats(self) -> None:
        self._stepper.resolve()
        self.stats.reset()
