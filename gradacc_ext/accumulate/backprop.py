"""One micro-batch's backward into the window: a mixin of GradientAccumulator (accumulator.py).

It weighs the loss or arms the gradient hooks, runs backward, counts the micro-step and closes the window on
the last one; a failed backward is undone, or the window discarded when undoing it cannot be exact. It uses the
collaborators that GradientAccumulator._attach() creates (hooks, buffers, window, window end, sync strategy).
"""

from __future__ import annotations

import warnings

import torch

from . import param_grads
from .window import weigh_loss


class AccumulatorBackprop:
    """Backpropagating one micro-batch, or one part of it, into a GradientAccumulator's window."""

    def _backprop(
        self,
        loss: torch.Tensor,
        weight: float | torch.Tensor,
        count: float | torch.Tensor,
        *,
        weighted: bool,
        completes_micro_batch: bool,
    ) -> bool:
        """Backward of one micro-batch or of one part of it (the adaptive accumulator's splits).

        weight multiplies this part's gradient and count is its share of the
        window's normaliser; only the part that completes a micro-batch counts
        as a micro-step, and only it can close the window.
        """
        final = completes_micro_batch and (self._closing or self.sync_gradients)
        scaled = self._loss_scale.scale(loss) if self._loss_scale is not None else loss
        # FSDP2/HSDP and DDP overlap reduce inside backward, before the hooks could weight: weigh the loss.
        weigh = not self._sync.weights_micro_batches and not (isinstance(weight, float) and weight == 1.0)
        backpropagated, weight = (weigh_loss(scaled, weight), 1.0) if weigh else (scaled, weight)
        # False: the wrapper reduces straight into the buffers (DDP overlap's closing backward); no folding.
        folds = self._sync.before_backward(final, self._buffers)
        if folds:
            self._hooks.arm(weight)
        try:
            # Backward runs outside autocast (torch's recommendation); ops reuse the forward's dtypes.
            with torch.autocast(self.device.type, enabled=False):
                backpropagated.reshape(()).backward()
            self._hooks.fold_rest() if folds else self._drop_grads()
        except BaseException:
            self._abort_backward(undoable=folds)
            raise
        self._window.commit(weighted, count, completes_micro_batch)
        last = scaled.detach()  # mse_loss's 0-d loss views its micro-batch's losses: hold only the value
        self._last_backpropagated = last.clone() if last.untyped_storage().nbytes() > last.element_size() else last
        self._backward_done = True
        if completes_micro_batch:
            self.stats.micro_step()
        if final:
            self._end.close(self._window)
        return final

    def _abort_backward(self, undoable: bool = True) -> None:
        """A failed backward: undo what it folded, or discard the window when that cannot be exact."""
        self._drop_grads()
        if not self._hooks.abort() or not undoable:
            self._buffers.release()
            self._window.reset()
            warnings.warn(
                "GradientAccumulator: a backward failed after part of its gradient was added to the window's sums; "
                "the open window was discarded (the next micro-batch starts a new one)",
                RuntimeWarning,
                stacklevel=3,
            )

    def _drop_grads(self) -> None:
        param_grads.clear(self.params)
