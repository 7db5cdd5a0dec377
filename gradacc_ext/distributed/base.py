"""The seam between the accumulator and data-parallel wrappers: one strategy object per model.

The accumulator owns flat buffers and the window's arithmetic; a strategy
says how a window's micro-steps meet the wrapper's communication. The
accumulator calls, in order:

  context(final)            around each micro-step's forward and backward
  before_backward(final, b) right before each backward; False: the accumulator's hooks do not fold
                            this backward (the wrapper reduces straight into the buffers)
  layout / local_grad       the buffers mirror local shards and take gradients' local shards
  release_held(hooks)       flush() of a short window: the wrapper's held sums into the buffers (FSDP2)
  before_finish()           at the window end, before any collective; may refuse with a clear error
  reduce(buffers, count)    buffers and item count become sums over ranks
  global_norm(...)          norm and found_inf become global over shards
  param_grad(i, view)       wraps a buffer view as param.grad for the optimizer
  wrap_state / unwrap_state checkpoint form (torch.distributed.checkpoint for shards)

Strategies: LocalSync (one process), DDPSync / DDPOverlapSync (ddp.py),
FSDP2Sync (fsdp.py, fully_shard and HSDP). grad_sync.grad_sync_for picks one
after validate.check_setup has checked the setup (before any collective).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch


class GradBuffers(Protocol):
    """What a strategy uses of the accumulator's flat buffers (gradacc_ext.accumulate.buffers.GradBuffers).

    Described here, by the strategies that use it, so that imports run one way: accumulate/ -> distributed/.
    """

    params: list[torch.nn.Parameter]
    layout: list[torch.Tensor]  # per parameter: the tensor its view mirrors (a sharded one's local shard)
    buf_dtypes: list[torch.dtype]
    views: list[torch.Tensor]  # per parameter: its view of the flat buffer of its dtype
    flats: dict[torch.dtype, torch.Tensor]
    device: torch.device

    def include_all(self) -> None: ...  # every view holds this window's value (zero where none came)


class GradHooks(Protocol):
    """What flush() hands a strategy of the accumulator's gradient hooks (gradacc_ext.accumulate.hooks.GradHooks)."""

    def arm(self, weight: float | torch.Tensor) -> None: ...  # the next gradients fold in, weighted
    def fold_rest(self) -> None: ...  # folds what arrived since the last bucket, then disarms
    def abort(self) -> None: ...  # disarms after a failure


class SyncConfig(Protocol):
    """The fields of gradacc_ext.GradientAccumulationConfig that choose and check a strategy."""

    world_size: int
    target_batch_size: int | None
    micro_batch_size: int | None
    accum_dtype: torch.dtype | None
    sharding: str
    fsdp_reduce: str
    ddp_reduce: str
    comm_dtype: torch.dtype | None
    peer_watch: str


class LocalSync:
    """A single process, or parameters without a data-parallel wrapper."""

    needs_context = False  # forward and backward must run inside micro_step()
    reduces = False  # the accumulator sums buffers and counts across ranks itself
    weights_micro_batches = True  # False: reduced in backward, before the hooks: weights go into the loss
    splits_alone = True  # no collective inside a micro-step: ranks may split a micro-batch differently (adaptive)
    # The window's last fold writes its final sums (nothing reduces them after it), so that fold can gather the
    # window's norm (accumulate/fold_norm.py) and the window end need not read the buffers again.
    sums_final_at_last_fold = True
    name = "local"

    def context(self, final: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def before_backward(self, final: bool, buffers: GradBuffers) -> bool:
        """Called right before each micro-step's backward (final: it closes the window); True: fold its grads."""
        return True

    def layout(self, params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
        """The tensors whose shapes the flat buffers mirror (a sharded parameter's local shard)."""
        return list(params)

    def local_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        return grad

    def param_grad(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """What the optimizer sees as params[index].grad for the buffer view (or cast copy) `grad`."""
        return grad

    def reduce(self, buffers: GradBuffers, count: torch.Tensor) -> None:
        """Sums the window's buffers and item count over ranks (in place)."""

    def release_held(self, hooks: GradHooks) -> None:
        """flush() of a short window: hands the wrapper's still-held sums to the armed-and-folded `hooks`
        (the accumulator's GradHooks), as a synced backward would; nothing held here."""

    def before_finish(self) -> None:
        """Called once at every window end, before reduce; raises when the window cannot be closed here."""

    def global_norm(self, norm: torch.Tensor, found_inf: torch.Tensor, norm_type: float) -> None:
        """Turns this rank's norm and found_inf into the global ones (in place)."""

    def wrap_state(self, state: dict[str, Any], buffers: GradBuffers) -> dict[str, Any]:
        """The accumulator's state_dict() in the form this strategy checkpoints (a new dict)."""
        return state

    def unwrap_state(self, state: dict[str, Any], buffers: GradBuffers) -> dict[str, Any]:
        """The inverse of wrap_state, for load_state_dict()."""
        return state
