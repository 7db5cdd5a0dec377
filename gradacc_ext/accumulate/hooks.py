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
from .grad_views import GradViews
from .window_sums import WindowSums

# Parameter -> the GradHooks that owns it (weakly on both sides).
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


class GradHooks:
    """Queues gradients as autograd produces them and folds them into the window's `sums` in buckets."""

    def __init__(
        self, params: Sequence[torch.nn.Parameter], sums: WindowSums, bucket_bytes: int, grad_views: bool = False
    ) -> None:
        for i, p in enumerate(params):
            owner = _OWNERS.get(p)
            if owner is not None and owner() is not None:
                raise RuntimeError(
                    f"GradientAccumulator: trainable parameter {i} (shape {list(p.shape)}) already belongs to another "
                    "GradientAccumulator; close() that one first (or use it as a context manager)"
                )
        self.params = list(params)
        self.sums = sums
        self.buffers = sums.buffers  # the layout (linear_fusion.py checks which parameters it can fuse)
        self.bucket_bytes = bucket_bytes
        self.views = GradViews(sums, grad_views)
        self.armed = False
        self.weight: float | torch.Tensor = 1.0
        self._queue: dict[int, torch.Tensor] = {}
        self._queued_bytes = 0
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
        """Starts folding, with `weight` for every gradient of this backward (inside the sums' open micro-step)."""
        self.armed, self.weight = True, weight
        if self.views.begin(weight):
            self.sums.writes_in_place()  # autograd adds into the attached views itself

    def fold_rest(self) -> None:
        """Backward returned: fold the queue, and gradients left in param.grad by backwards outside ours."""
        for i, p in enumerate(self.params):
            if p.grad is not None and not self.views.owns(i):
                self._take(i, p)
        self._fold()
        self.views.install(self.weight)
        self.armed = False

    def abort(self) -> None:
        """Backward failed: drop the queue and stop folding (the caller rolls the sums back)."""
        self._queue, self._queued_bytes = {}, 0
        self.armed = False

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
        self.sums.add(index, grads, self.weight)


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
