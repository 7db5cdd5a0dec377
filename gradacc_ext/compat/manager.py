"""Seed 002's GradientAccumulationManager: accumulate_gradients(loss, model), should_update(batch_idx),
update_optimizer(optimizer, model), over one GradientAccumulator.

The guide gives the manager its optimizer only at update_optimizer(), after
the first window's losses. Until then the manager holds those losses (and
their graphs) and backpropagates them when the optimizer arrives; it warns
once, because that holds a window of activations. Give optimizer= to the
constructor and nothing is held. From then on every loss goes straight into
the accumulator, whose last backward of a window takes the optimizer step;
update_optimizer() reports it.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..accumulate import AdaptiveGradientAccumulator, GradientAccumulationConfig, GradientAccumulator
from ..accumulate.guide_devices import MemoryMonitor


def build_accumulator(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: GradientAccumulationConfig, **kwargs: Any
) -> GradientAccumulator | AdaptiveGradientAccumulator:
    """The accumulator a guide's strategy asks for: the OOM-splitting one for "dynamic"/"adaptive"."""
    cls = GradientAccumulator if config.strategy == "standard" else AdaptiveGradientAccumulator
    return cls(model, optimizer, config, **kwargs)


class GradientAccumulationManager:
    """One accumulation window at a time for a hand-written loop (seed 002's custom implementation)."""

    def __init__(
        self,
        config: GradientAccumulationConfig,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        self.config = config
        self.optimizer = optimizer
        self.scaler = scaler
        self.accumulator: GradientAccumulator | None = None
        self.model: torch.nn.Module | None = None
        self.monitor = MemoryMonitor()
        self._held: list[tuple[torch.Tensor, Any]] = []
        self._closed = False

    def accumulate_gradients(self, loss: torch.Tensor, model: torch.nn.Module, num_items: Any = None) -> bool:
        """Backpropagates one micro-batch's loss; True when it closed a window (the step is taken)."""
        self._check_model(model)
        if self.accumulator is None and self.optimizer is None:
            if not self._held:
                warnings.warn(
                    "GradientAccumulationManager: no optimizer yet, so the first window's losses (and their "
                    "graphs) are held until update_optimizer(); pass optimizer= to the constructor to avoid it",
                    UserWarning,
                    stacklevel=2,
                )
            self._held.append((loss, num_items))
            self._closed = len(self._held) == self.config.accumulation_steps
            return self._closed
        self._closed = self._attach(model, self.optimizer).backward(loss, num_items)
        return self._closed

    def should_update(self, batch_idx: int | None = None) -> bool:
        """Whether the last micro-batch closed a window (batch_idx is accepted for the guide's call shape;
        the accumulator counts the window itself)."""
        return self._closed

    def update_optimizer(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, Any]:
        """Reports the step the closing micro-batch took; with a window still open, applies it (flush())."""
        self._check_model(model)
        if self.optimizer is not None and optimizer is not self.optimizer:
            raise ValueError("GradientAccumulationManager.update_optimizer: a different optimizer than before")
        self.optimizer = optimizer
        acc = self._attach(model, optimizer)
        held, self._held = self._held, []
        for loss, num_items in held:
            acc.backward(loss, num_items)
        if acc.micro_steps_in_window:
            acc.flush()
        self._closed = False
        return {
            "optimizer_steps": acc.optimizer_steps,
            "skipped": acc.last_step_skipped,
            "grad_norm_history_len": len(acc.grad_norm_history()),
            "loss_scale": acc.loss_scale(),
        }

    def check_memory_and_adjust(self, model: torch.nn.Module | None = None) -> dict[str, Any]:
        """A memory report; nothing is adjusted here (the adaptive strategy splits on out-of-memory)."""
        return {
            **self.monitor.get_memory_usage(),
            "adjusted": False,
            "reason": "gradacc_ext adapts on out-of-memory errors (AdaptiveGradientAccumulator.step_batch)",
        }

    def get_status(self) -> dict[str, Any]:
        acc = self.accumulator
        return {
            "accumulation_steps": self.config.accumulation_steps,
            "accumulation_step": len(self._held) if acc is None else acc.micro_steps_in_window,
            "effective_batch_size": self.config.effective_batch_size,
            "optimizer_steps": 0 if acc is None else acc.optimizer_steps,
            "micro_steps": len(self._held) if acc is None else acc.stats.micro_steps,
            "held_losses": len(self._held),
        }

    def _check_model(self, model: torch.nn.Module) -> None:
        if self.model is None:
            self.model = model
        elif model is not self.model:
            raise ValueError("GradientAccumulationManager: a different model than in the earlier calls")

    def _attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> GradientAccumulator:
        if self.accumulator is None:
            self.accumulator = build_accumulator(model, optimizer, self.config, scaler=self.scaler)
        return self.accumulator
