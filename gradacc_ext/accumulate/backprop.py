"""One backward into the window: weigh the loss or arm the gradient hooks, run backward, count the micro-step.

Each backward is a transaction of the window's sums (window_sums.py): begun before, committed after;
a failed backward is rolled back, and when the sums cannot return exactly to the last commit they
are discarded and the window's counters reset with them (`discarded` tells the accumulator, which
warns, or runs the window again: adaptive.py). Backprop works on the collaborators that
GradientAccumulator builds (loss scale, sync strategy, buffers, hooks, window, stats) and owns the
last backpropagated loss; the accumulator decides whether a backward closes the window and closes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..distributed.base import LocalSync
from . import param_grads
from .buffers import GradBuffers
from .hooks import GradHooks
from .loss_scale import LossScale
from .stats import AccumulatorStats
from .window import Window, weigh_loss


class Backprop:
    """Backpropagates one micro-batch, or one part of it, into the window."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        device: torch.device,
        loss_scale: LossScale | None,
        sync: LocalSync,
        buffers: GradBuffers,
        hooks: GradHooks,
        window: Window,
        stats: AccumulatorStats,
    ) -> None:
        self.params, self.device = list(params), device
        self.loss_scale, self.sync = loss_scale, sync
        self.buffers, self.hooks, self.window, self.stats = buffers, hooks, window, stats
        self.sums = buffers.sums
        self.discarded = False  # the last backward failed and discarded the open window
        self.last_loss: torch.Tensor | None = None  # the last backpropagated loss, as scaled (detached)

    def run(
        self,
        loss: torch.Tensor,
        weight: float | torch.Tensor,
        count: float | torch.Tensor,
        *,
        weighted: bool,
        completes_micro_batch: bool,
        final: bool,
    ) -> None:
        """Backward of one micro-batch or of one part of it (the adaptive accumulator's splits).

        weight multiplies this part's gradient and count is its share of the
        window's normaliser; only the part that completes a micro-batch counts
        as a micro-step. final: this backward closes the window (the caller closes it after).
        """
        scaled = self.loss_scale.scale(loss) if self.loss_scale is not None else loss
        # FSDP2/HSDP and DDP overlap reduce inside backward, before the hooks could weight: weigh the loss.
        weigh = not self.sync.weights_micro_batches and not (isinstance(weight, float) and weight == 1.0)
        backpropagated, weight = (weigh_loss(scaled, weight), 1.0) if weigh else (scaled, weight)
        self.discarded = False
        self.sums.begin(last=final)  # the window's last micro-step: its folds gather the norm (fold_norm.py)
        # False: the wrapper reduces straight into the buffers (DDP overlap's closing backward); no folding.
        folds = self.sync.before_backward(final, self.buffers)
        if folds:
            self.hooks.arm(weight)
        else:
            self.sums.writes_in_place()
        try:
            # Backward runs outside autocast (torch's recommendation); ops reuse the forward's dtypes.
            with torch.autocast(self.device.type, enabled=False):
                backpropagated.reshape(()).backward()
            self.hooks.fold_rest() if folds else self.drop_grads()
        except BaseException:
            self.discarded = not self.abort()
            raise
        self.sums.commit()
        self.window.commit(weighted, count, completes_micro_batch)
        last = scaled.detach()  # mse_loss's 0-d loss views its micro-batch's losses: hold only the value
        self.last_loss = last.clone() if last.untyped_storage().nbytes() > last.element_size() else last
        if completes_micro_batch:
            self.stats.micro_step()

    def abort(self) -> bool:
        """A failed backward: roll the window's sums back (True), or discard the window where that cannot be exact."""
        self.drop_grads()
        self.hooks.abort()
        if self.sums.rollback():
            self.hooks.views.restore()
            return True
        self.buffers.release()
        self.window.reset()
        return False

    def drop_grads(self) -> None:
        """Drops what autograd left in param.grad (a failed or unfolded backward's partial gradients)."""
        param_grads.clear(self.params)
