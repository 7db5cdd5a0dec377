"""Seed 002's GradientAccumulationTrainer (named in seed 001): train_epoch() over a loader, one
micro-batch per batch, through GradientAccumulator.step_batch (the adaptive one splits on OOM)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

from ..accumulate import GradientAccumulationConfig
from .manager import build_accumulator


class GradientAccumulationTrainer:
    """Trains `model` on `train_loader` batches of (inputs, targets); loss_fn(outputs, targets) is a mean
    loss (default: cross-entropy, as the guides' criterion). Micro-batches are weighted by their size, so
    a short last batch counts for what it holds; an epoch's last batch closes its short last window
    (acc.iterate, so no flush() is needed)."""

    def __init__(
        self,
        model: torch.nn.Module,
        train_loader: Iterable,
        config: GradientAccumulationConfig,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        scheduler: Any | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        self.model = model
        self.train_loader = train_loader
        self.config = config
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loss_fn = loss_fn if loss_fn is not None else F.cross_entropy
        self.accumulator = build_accumulator(model, optimizer, config, scheduler=scheduler, scaler=scaler)

    def _loss(self, model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
        inputs, targets = batch
        loss = self.loss_fn(model(inputs), targets)
        self._loss_sum += loss.detach().float() * len(targets)
        self._items += len(targets)
        return loss, len(targets)

    def train_epoch(self, epoch: int = 0) -> dict[str, Any]:
        """One pass over the loader; train_loss is the item-weighted mean of the batch losses (one host read)."""
        self.model.train()
        acc = self.accumulator
        self._loss_sum, self._items = torch.zeros((), device=acc.device), 0
        steps_before = acc.optimizer_steps
        for batch in acc.iterate(self.train_loader):  # the last batch closes the short last window
            acc.step_batch(batch, self._loss)
        return {
            "epoch": epoch,
            "train_loss": float(self._loss_sum / max(self._items, 1)),
            "optimizer_steps": acc.optimizer_steps - steps_before,
            "accumulation_stats": acc.get_accumulation_stats(),
        }
