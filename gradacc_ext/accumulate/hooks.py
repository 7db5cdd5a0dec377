"""Folding gradients into the buffers while backward runs, in buckets, through post-accumulate-grad hooks.

Every trainable parameter gets a Tensor.register_post_accumulate_grad_hook.
When autograd has accumulated a parameter's gradient (once per backward,
after all its uses are summed: tied weights fire once), the hook takes the
gradient off param.grad at once and queues it; when the queued gradients
reach bucket_bytes, they are folded into the buffers with one multi-tensor
launch (on CUDA, on the current stream, so it overlaps the rest of backward).
What is left queued is folded when backward returns, and so is any gradient
that a backward outside the accumulator left in param.grad (it is counted in
this micro-step). Peak gradient memory in backward is therefore the buffers
plus the gradient autograd just produced (the default bucket_bytes=1 folds
each one at once: the plain loop holds that gradient too, while adding it
into .grad) or plus about one bucket, instead of the buffers plus a full set
of gradients.

With config.grad_views, parameters whose gradient dtype is their buffer's
get param.grad as a view of the buffer after their first micro-step, and
autograd adds into it in place; the hooks leave those alone (grad_views.py).

The hooks fold only while armed (inside the accumulator's backward); a
backward run by the user outside it leaves param.grad to autograd, and the
next armed backward picks it up.

Ownership: one GradHooks per parameter at a time (a second accumulator over
the same parameters is an error); close() removes the hooks, and so does
garbage collection (a weakref finalizer), since the hooks hold the owner
only weakly.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import param_grads
from .buffers import GradBuffers
from .grad_views import GradViews

# Parameter -> the GradHooks that owns it (weakly on both sides).
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


class GradHooks:
    """Queues gradients as autograd produces them and folds them into `buffers` in buckets."""

    def __init__(
        self, params: Sequence[torch.nn.Parameter], buffers: GradBuffers, bucket_bytes: int, grad_views: bool = False
    ) -> None:
        for i, p in enumerate(params):
            owner = _OWNERS.get(p)
            if owner is not None and owner() is not None:
                raise RuntimeError(
                    f"GradientAccumulator: trainable parameter {i} (shape {list(p.shape)}) already belongs to another "
                    "GradientAccumulator; close() that one first (or use it as a context manager)"
                )
        self.params = list(params)
        self.buffers = buffers
        self.bucket_bytes = bucket_bytes
        self.views = GradViews(buffers, grad_views)
        self.armed = False
        self.weight: float | torch.Tensor = 1.0
        self._queue: dict[int, torch.Tensor] = {}
        self._queued_bytes = 0
        self._folded_again = False  # this backward added to a view that held an earlier micro-step's sum
        self._assigned: list[int] = []  # views this backward wrote first (restorable by unmarking them)
        me = weakref.ref(self)
        handles = [p.register_post_accumulate_grad_hook(_hook(me, i)) for i, p in enumerate(self.params)]
        for p in self.params:
            _OWNERS[p] = me
        self._finalizer = weakref.finalize(self, _remove, handles, list(self.params))

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Removes the hooks and releases the parameters (idempotent)."""
        self._finalizer()

    # -- one backward -----------------------------------------------------------------------------------------------

    def arm(self, weight: float | torch.Tensor) -> None:
        """Starts folding, with `weight` for every gradient of this backward."""
        self.armed, self.weight = True, weight
        self._assigned = []
        # Autograd adds into attached views in place: a failure in this backward cannot be undone.
        self._folded_again = self.views.begin(weight)

    def fold_rest(self) -> None:
        """Backward returned: fold the queue, and gradients left in param.grad by backwards outside ours."""
        for i, p in enumerate(self.params):
            if p.grad is not None and not self.views.owns(i):
                self._take(i, p)
        self._fold()
        self.views.install(self.weight)
        self.armed = False

    def abort(self) -> bool:
        """Backward failed: drop the queue and this backward's first writes; False if it cannot be undone exactly.

        A view that already held earlier micro-steps' sum and got part of the
        failed backward added cannot be restored; the caller discards the window.
        """
        self._queue, self._queued_bytes = {}, 0
        for i in self._assigned:
            self.buffers.seen[i] = False
        self.armed = False
        return not self._folded_again

    def write_directly(self, i: int) -> bool:
        """A writer beside the hooks (linear_fusion.py) writes view i itself now: True to add, False to assign.

        It is booked as a fold: abort() can undo a first write, not an addition to an earlier micro-step's sum.
        """
        self.buffers._ensure()
        again = self.buffers.seen[i]
        self._folded_again |= again
        if not again:
            self.buffers.seen[i] = True
            self._assigned.append(i)
        return again

    def _ready(self, i: int, param: torch.Tensor) -> None:
        if not self.armed:
            self.views.check_unarmed(i)
        elif not self.views.owns(i) and param.grad is not None:  # None: a fused Linear wrote it (linear_fusion.py)
            self._take(i, param)

    def _take(self, i: int, param: torch.Tensor) -> None:
        if i in self._queue:  # a second backward (retain_graph) before this bucket was folded
            self._fold()
        grad = param_grads.take(param)
        self._queue[i] = grad
        self._queued_bytes += grad.numel() * grad.element_size()
        if self._queued_bytes >= self.bucket_bytes:
            self._fold()

    def _fold(self) -> None:
        if not self._queue:
            return
        index, grads = list(self._queue), list(self._queue.values())
        self._queue, self._queued_bytes = {}, 0
        first = [i for i in index if not self.buffers.seen[i]]
        self._folded_again |= len(first) < len(index)
        self.buffers.add(index, grads, self.weight)
        self._assigned += first


def _hook(owner: weakref.ref, i: int):
    def hook(param: torch.Tensor) -> None:
        hooks = owner()
        if hooks is not None:
            hooks._ready(i, param)

    return hook


def _remove(handles: list, params: list[torch.nn.Parameter]) -> None:
    for handle in handles:
        handle.remove()
    for p in params:
        _OWNERS.pop(p, None)
