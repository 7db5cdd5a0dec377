"""The accumulator's read side: counters, loss scale, the window's state, norm history and callbacks.

Part of GradientAccumulator (its base class). A read's only effect is resolving a deferred fused step
(one host read); before attach() each read but accumulation_steps raises NotAttachedError (attachment.py).
The guides' stats dicts (guide_reports.py) are built from these reads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .stats import StepInfo, WindowState


class AccumulatorReads:
    """What GradientAccumulator reports; every value comes from its config or the collaborators attach() built."""

    @property
    def accumulation_steps(self) -> int:
        return int(self.config.accumulation_steps)

    @property
    def sync_gradients(self) -> bool:
        """True when the next backward closes the window (Accelerate's name)."""
        return self._data.ends or self._window.micro + 1 == self.accumulation_steps

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
            last_loss=self._backprop.last_loss,
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
