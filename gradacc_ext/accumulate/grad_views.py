"""param.grad as a view of the flat buffer, so autograd accumulates in place (config.grad_views).

DDP's gradient_as_bucket_view for the accumulator: where a parameter's
gradient dtype equals its buffer dtype, param.grad is set to its view of the
flat buffer after the micro-step that first wrote it, and autograd's
AccumulateGrad then adds later micro-steps' gradients into the buffer in
place: no gradient is queued, no fold runs for it, and nothing beyond the
gradient autograd is adding is held.

The window's first micro-step is not a view step: param.grad is None, the
hooks path assigns the first gradient (so the uninitialised buffer is never
read and no zeroing pass exists), and the views are installed after it.

Exactness: autograd adds with weight 1, so views are attached only while
every micro-step's weight is exactly 1.0 ("mean" without num_items, "sum",
"none"). A backward with another weight (num_items in "mean" mode, the
adaptive accumulator's splits) detaches them first and runs on the hooks
path. fp16 loss scaling is in the loss and constant within a window, so
it is exact too.

What .grad shows between micro-steps (docs/memory.md, "What a window holds"): with views, the
window's running, un-normalised (and fp16: still loss-scaled) sum; without,
None. Setting .grad to None between micro-steps (e.g. a leftover
zero_grad()) detaches the view and loses nothing: the buffer keeps the sum,
and whatever autograd then puts into .grad (a backward outside the
accumulator) is counted as on the hooks path. A backward(create_graph=True)
while views are attached would replace .grad by sum + gradient out of
place; it is refused with a clear error (use torch.autograd.grad for
gradient penalties, or grad_views=False).
"""

from __future__ import annotations

import torch

from . import param_grads
from .window_sums import WindowSums


class GradViews:
    """Attaches buffer views as param.grad between micro-steps of a weight-1 window."""

    def __init__(self, sums: WindowSums, enabled: bool) -> None:
        self.sums = sums
        buffers = sums.buffers
        self.params = buffers.params
        # Not for FSDP2's sharded parameters (their layout is the local shard, not the parameter): their
        # gradients come from FSDP's reduce-scatter as DTensors.
        self.eligible = [
            i
            for i, (p, t) in enumerate(zip(buffers.params, buffers.layout, strict=True))
            if enabled and t is p and buffers.buf_dtypes[i] == p.dtype
        ]
        self.attached: set[int] = set()  # views that are param.grad during this backward
        self._before: set[int] = set()  # views attached when this backward began (restore() re-attaches them)

    def begin(self, weight: float | torch.Tensor) -> bool:
        """Before a backward: keep the attached views if `weight` is 1, detach them otherwise.

        Returns whether views are attached: autograd will then write into the
        buffers, so a failure in this backward cannot be undone.
        """
        keep = not isinstance(weight, torch.Tensor) and weight == 1.0
        attached = {i for i in self.attached if self._is_view(i)}
        for i in self.attached - attached:
            if self.sums.is_view(i, self.params[i].grad):
                param_grads.show(self.params[i], None)  # a view whose sum a resume dropped: stale
        self._before = attached
        if not keep:
            param_grads.clear(self.params[i] for i in attached)
            attached = set()
        self.attached = attached
        return bool(attached)

    def restore(self) -> None:
        """After an exact rollback: the views attached when the failed backward began show the restored sums."""
        self.attached = {i for i in self._before if self.sums.written(i)}
        for i in self.attached:
            param_grads.show(self.params[i], self.sums.view(i))

    def owns(self, i: int) -> bool:
        """Whether parameter i's gradient went into its view (then the hooks path leaves it alone)."""
        if i not in self.attached:
            return False
        if self._is_view(i):
            return True
        self.attached.discard(i)  # .grad was dropped or replaced: the hooks path counts what is there
        return False

    def check_unarmed(self, i: int) -> None:
        """A backward outside the accumulator reached parameter i: refuse an out-of-place add into its view."""
        if i in self.attached and torch.is_grad_enabled() and not self._is_view(i):
            param_grads.show(self.params[i], self.sums.view(i))  # undo: the buffer still holds the sum
            raise RuntimeError(
                "GradientAccumulator(grad_views=True): backward(create_graph=True) while .grad is a view of the "
                "accumulator's buffer would replace it by sum + gradient; use torch.autograd.grad for gradient "
                "penalties, or grad_views=False"
            )

    def install(self, weight: float | torch.Tensor) -> None:
        """After a backward of weight 1: parameters with a sum in the buffers get their view as .grad."""
        if isinstance(weight, torch.Tensor) or weight != 1.0:
            return
        for i in self.eligible:
            p = self.params[i]
            if self.sums.written(i) and p.grad is None:
                param_grads.show(p, self.sums.view(i))
                self.attached.add(i)

    def _is_view(self, i: int) -> bool:
        """Whether param i's .grad is still its view holding this window's sum (not after a reset or resume)."""
        return self.sums.written(i) and self.sums.is_view(i, self.params[i].grad)
