"""The open window's micro-batches, kept by AdaptiveGradientAccumulator so that it can run the window again.

An out-of-memory error in a chunk's backward after the window's sums already held earlier chunks' or
micro-batches' gradients cannot be rolled back exactly without a second copy of the sums
(window_sums.py): the sums are discarded. The adaptive accumulator then runs the window's earlier
micro-batches again, at the new chunk size, and retries the failed one from its first chunk, so the
window's gradient is still the full batch's. This log is what it runs again.

Cost: references to the open window's batches (their tensors stay alive until the window closes: the
inputs only, no gradient memory) and, only after such an error, the earlier micro-batches' forward
and backward again. What a second run cannot repeat is refused with an error naming it: a window that
also holds micro-batches given through backward() or loaded from a checkpoint, and a batch whose
tensors were written in place since (e.g. a loader that reuses its buffers; tensors' version counters
tell). A second forward updates running statistics (BatchNorm) again and draws new dropout masks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LoggedBatch:
    """One micro-batch as step_batch() ran it."""

    data: Any
    loss_fn: Callable
    total: int  # items along dim 0
    tensors: tuple[torch.Tensor, ...]
    versions: tuple[int, ...]  # the tensors' version counters when it ran

    @classmethod
    def of(cls, data: Any, loss_fn: Callable, total: int, tensors: list[torch.Tensor]) -> LoggedBatch:
        return cls(data, loss_fn, total, tuple(tensors), tuple(t._version for t in tensors))

    def changed(self) -> bool:
        return any(t._version != v for t, v in zip(self.tensors, self.versions, strict=True))


class WindowLog:
    """The micro-batches of the open window that step_batch() ran, or None once it holds others."""

    def __init__(self) -> None:
        self._batches: list[LoggedBatch] | None = []

    def start(self, micro: int) -> None:
        """A step_batch() begins with `micro` micro-batches in the window (0: a new window)."""
        if micro == 0:
            self._batches = []

    def record(self, batch: LoggedBatch) -> None:
        """`batch` completed as a micro-batch of the open window (a micro-batch that closed it is not kept)."""
        if self._batches is not None:
            self._batches.append(batch)

    def forget(self) -> None:
        """The window now holds a micro-batch this log cannot run again (backward(), a loaded checkpoint)."""
        self._batches = None

    def earlier(self, micro: int, cause: BaseException) -> list[LoggedBatch]:
        """The window's `micro` earlier micro-batches, to run again; a RuntimeError (from `cause`, the error that
        discarded the window) when that cannot be exact."""
        batches = self._batches
        if batches is None or len(batches) != micro:
            raise RuntimeError(
                "AdaptiveGradientAccumulator: out of memory in backward after the window's sums already held "
                "earlier micro-batches, which cannot be rolled back exactly, and this window also holds micro-batches "
                "that did not come through step_batch() (backward() or a loaded checkpoint), which cannot be run "
                "again; the open window was discarded. Use step_batch() for every micro-batch of a window"
            ) from cause
        changed = [k for k, b in enumerate(batches) if b.changed()]
        if changed:
            raise RuntimeError(
                "AdaptiveGradientAccumulator: out of memory in backward after the window's sums already held "
                "earlier micro-batches, so the window must run them again, but the window's micro-batch(es) "
                f"{changed} (0-based) were changed in place since step_batch() ran them; the open window was "
                "discarded. Pass batches that stay unchanged until the window closes (e.g. no reused loader buffers)"
            ) from cause
        return list(batches)
