"""The window's sums as a transaction: the one owner of which buffer views hold this window's sum.

Every writer of the buffers during a micro-step goes through WindowSums' methods: the hooks' folds
(add), the Linear fusion's GEMM writes (write_directly, which hands out the view and its beta), and
autograd's own in-place additions into views shown as .grad (writes_in_place: grad views, DDP
overlap's closing backward). Readers ask written(i) / view(i). A micro-step is a transaction:
begin() ... commit(), or rollback() when its backward failed.

What a rollback can restore exactly, without holding a copy of anything:
- a view the failed micro-step wrote FIRST in this window: its old content is "nothing", so unmarking it
  is exact (its next first write assigns; the stale values are never read), even if the same
  micro-step added to it again afterwards (a tied weight: the fusion's write, then the hooks' fold);
- nothing else. An addition into an earlier micro-step's sum cannot be undone: subtracting rounds
  (and inf - inf is NaN), and keeping a copy of the sums (or staging each micro-step's gradients until
  it ends) would hold a second set of gradients, above the plain loop's peak (docs/memory.md).
Then rollback() discards the window's sums and says so; the caller resets the window's counters, and
the adaptive accumulator rebuilds the window by running its micro-batches again (adaptive.py).

The open micro-step's log (`_first`, `_exact`, emptied by `_clear_log`) is the place for any other
per-micro-step partial state that must be kept or dropped together with the sums: the window's last
micro-step's norm partials (fold_norm.py) live there, so a rolled-back last micro-step drops them
with its writes. Unlike the rest of the log they outlive commit(): the window end reads them.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from .fold_norm import FoldNorm

if TYPE_CHECKING:
    from .buffers import GradBuffers


class WindowSums:
    """Which views of `buffers` hold this window's sum, and the open micro-step's writes into them."""

    def __init__(self, buffers: GradBuffers) -> None:
        # GradBuffers owns its WindowSums: a weak reference back, so that no reference cycle keeps the flat buffers
        # alive after the accumulator is dropped (until a garbage collection).
        self.buffers: GradBuffers = weakref.proxy(buffers)
        self._written = [False] * len(buffers.params)
        # The norm order the window's last fold gathers partials of (WindowEnd sets it where they are final
        # at that fold: one process, the fused step, norm type 2 or inf); None: the window end's full pass.
        self.fold_norm_type: float | None = None
        self._clear_log()

    # -- reading ----------------------------------------------------------------------------------------------------

    def written(self, i: int) -> bool:
        """Whether parameter i's view holds this window's sum."""
        return self._written[i]

    def indices(self) -> list[int]:
        """The parameters whose views hold this window's sum, in parameter order."""
        return [i for i, w in enumerate(self._written) if w]

    def view(self, i: int) -> torch.Tensor:
        """Parameter i's view of the buffers (allocating them on a window's first write)."""
        self.buffers._ensure()
        return self.buffers.views[i]

    def is_view(self, i: int, tensor: torch.Tensor | None) -> bool:
        """Whether `tensor` is parameter i's view (allocates nothing)."""
        return bool(self.buffers.views) and tensor is self.buffers.views[i]

    def last_fold(self) -> FoldNorm | None:
        """The committed last micro-step's norm partials, if it gathered them and none went stale."""
        norm = self._norm
        return norm if norm is not None and not norm.stale else None

    # -- one micro-step ---------------------------------------------------------------------------------------------

    def begin(self, last: bool = False) -> None:
        """A micro-step starts: what the views hold now is what rollback() returns to.

        last: it closes the window, so its folds gather the norm's partials (where fold_norm_type is set).
        """
        self._clear_log()
        if last and self.fold_norm_type is not None:
            self._norm = FoldNorm(self.fold_norm_type, self.buffers.device)

    def add(self, index: Sequence[int], grads: Sequence[torch.Tensor], scale: float | torch.Tensor) -> None:
        """views[index] += scale * grads (distinct indices); a view's first gradient of the window is assigned."""
        first = [k for k, i in enumerate(index) if not self._written[i]]
        again = [k for k, i in enumerate(index) if self._written[i]]
        self._adding_to(index[k] for k in again)
        if self._norm is not None:
            self._norm.folding(index)
        for part, assign in ((first, True), (again, False)):
            if part:
                self.buffers.accumulate(
                    [index[k] for k in part], [grads[k] for k in part], scale, assign=assign, norm=self._norm
                )
        self._mark(index[k] for k in first)

    def write_directly(self, i: int) -> tuple[torch.Tensor, float]:
        """A writer beside the hooks (linear_fusion.py) writes view i itself now: (the view, beta).

        beta 0.0: assign (the window's first write to it); 1.0: add to what it holds.
        """
        view = self.view(i)
        if self._norm is not None:
            self._norm.rewritten(i)
        again = self._written[i]
        if again:
            self._adding_to([i])
        else:
            self._mark([i])
        return view, float(again)

    def writes_in_place(self) -> None:
        """Autograd adds into views shown as .grad during this backward: a failure cannot be undone exactly."""
        self._exact = False

    def commit(self) -> None:
        """The micro-step's backward finished: its writes are part of the window (its norm partials stay)."""
        norm = self._norm
        self._clear_log()
        self._norm = norm

    def rollback(self) -> bool:
        """The micro-step's backward failed: restore the last commit (True), or, where that cannot be exact,
        discard the window's sums (False; the caller resets the window)."""
        if not self._exact:
            self.reset()
            return False
        for i in self._first:
            self._written[i] = False
        self._clear_log()
        return True

    def _clear_log(self) -> None:
        """Empties the open micro-step's log: what rollback() undoes (per-micro-step partial state goes here too)."""
        self._first: set[int] = set()  # views the open micro-step wrote first: undone by unmarking them
        self._exact = True  # whether rollback() can restore the last commit (no earlier sum was added to)
        self._norm: FoldNorm | None = None  # the window's last micro-step's norm partials (fold_norm.py)

    def _mark(self, index: Iterable[int]) -> None:
        for i in index:
            self._written[i] = True
            self._first.add(i)

    def _adding_to(self, index: Iterable[int]) -> None:
        # Adding into this micro-step's own first write is undone with it; into an earlier sum, not.
        if any(i not in self._first for i in index):
            self._exact = False

    # -- the window's boundaries ------------------------------------------------------------------------------------

    def include_all(self) -> None:
        """Zero the views that hold nothing yet and count them in (distributed sums run over whole buffers)."""
        self.buffers._ensure()
        for i, written in enumerate(self._written):
            if not written:
                self.buffers.views[i].zero_()
                self._written[i] = True

    def reset(self) -> None:
        """A new window: no view holds a sum."""
        self._written = [False] * len(self._written)
        self._clear_log()

    def restore(self, written: Sequence[bool]) -> None:
        """A loaded checkpoint's views hold its sums (the caller copied them in)."""
        self._written = list(written)
        self._clear_log()
