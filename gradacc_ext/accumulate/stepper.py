"""The window's optimizer step, its skip on non-finite gradients, and the scheduler step it defers.

Host syncs: per window, one (reading found_inf to skip a non-finite step)
when skip_nonfinite is on and the optimizer is not fused; none with a fused
optimizer (torch's Adam/AdamW/SGD with fused=True) or with the fused tail
(config.fused_step), which get found_inf as a tensor and skip on the device. Then whether the window was skipped is
read lazily: the scheduler step of window k (taken only if it was a real
step) happens just before window k+1's optimizer step, or whenever the
accumulator calls resolve() (flush, synchronize, a stats read), so every
optimizer step uses exactly the learning rate of the plain loop. Under data
parallelism it is read at once instead (eager=True): a lazy read would happen
whenever a rank reads a counter (a log line on rank 0), stepping that rank's
scheduler alone, and a checkpoint then holds per-rank learning rates, counters
and pending outcomes under keys that torch.distributed.checkpoint keeps once.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch

from ..optim.fused_step import FusedStep, Grads
from .stats import AccumulatorStats


class _DeferredFlag:
    """found_inf of a fused step, copied to the host without waiting; read when needed."""

    def __init__(self, flag: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if flag.is_cuda:
            self._host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
            self._host.copy_(flag, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flag.clone()

    def get(self) -> bool:
        if self._event is not None:
            self._event.synchronize()  # waits for this copy only, long done by the next window
        return bool(self._host.item())


class OptimizerStepper:
    """Steps the optimizer once per window (or skips it) and the scheduler once per real step."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None,
        skip_nonfinite: bool,
        stats: AccumulatorStats,
        eager: bool = False,
    ) -> None:
        self.optimizer = optimizer
        self.eager = eager  # resolve each step at once: every rank's state agrees at every point (data parallel)
        self.scheduler = scheduler
        self.skip_nonfinite = skip_nonfinite
        self.stats = stats
        # GradScaler's protocol: fused optimizers take found_inf (and grad_scale) as tensors.
        self.fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and skip_nonfinite
        self.pending: _DeferredFlag | None = None
        self._restored = False
        self.last_skipped: bool | None = None

    def step(self, found_inf: torch.Tensor) -> None:
        """optimizer.step() over param.grad, or no step when found_inf is set (skip_nonfinite)."""
        self.resolve()  # the scheduler's deferred step first: this step uses the lr it sets
        if self.fused:  # torch's fused optimizers skip on the device: GradScaler's protocol
            self.optimizer.grad_scale, self.optimizer.found_inf = None, self._skip_flag(found_inf)
            try:
                self.optimizer.step()  # the buffers are already unscaled: only found_inf
            finally:
                del self.optimizer.grad_scale, self.optimizer.found_inf
            self._stepped_on_device(found_inf)
            return
        skipped = self.skip_nonfinite and bool(found_inf.item())  # the window's one host sync
        if not skipped:
            self.optimizer.step()
        self._record(skipped)

    def step_fused(
        self, fused_step: FusedStep, grads: Grads, grad_mult: torch.Tensor | None, found_inf: torch.Tensor
    ) -> None:
        """One fused step over `grads` (the window's buffers), skipped on the device when found_inf is set."""
        self.resolve()  # the scheduler's deferred step first: this step uses the lr it sets
        fused_step(grads, grad_mult, self._skip_flag(found_inf))
        self._stepped_on_device(found_inf)

    def _skip_flag(self, found_inf: torch.Tensor) -> torch.Tensor | None:
        return found_inf if self.skip_nonfinite else None

    def _stepped_on_device(self, found_inf: torch.Tensor) -> None:
        """Records a step that skipped (or not) on the device: its outcome is read lazily, or at once (eager)."""
        if not self.skip_nonfinite:
            self._record(False)
            return
        self.pending = _DeferredFlag(found_inf)
        if self.eager:
            self.resolve()

    def resolve(self) -> None:
        """Reads a deferred fused step's outcome (one host read): counts it, steps the scheduler if real."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._record(pending.get())

    def pending_state(self) -> bool | None:
        """The deferred step's outcome (True: skipped), without acting on it; None when nothing is pending.

        A checkpoint saves it instead of resolving it: resolving steps the
        scheduler, whose state the caller has usually captured already.
        """
        return None if self.pending is None else self.pending.get()

    def restore(self, pending: bool | None) -> None:
        """Replaces the deferred outcome by a saved one (resolved, as in the saving run, at the next window)."""
        self.pending = None if pending is None else _DeferredFlag(torch.tensor(float(pending)))
        self.last_skipped = None
        self._restored = pending is not None

    def _record(self, skipped: bool) -> None:
        self.last_skipped = skipped
        self.stats.outcome(skipped)
        restored, self._restored = self._restored, False
        if not skipped and self.scheduler is not None:
            with warnings.catch_warnings():
                if restored:  # its optimizer step ran before the checkpoint, so torch's order check misfires
                    warnings.filterwarnings(
                        "ignore", message=re.escape("Detected call of `lr_scheduler.step()` before")
                    )
                self.scheduler.step()
