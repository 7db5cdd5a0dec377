"""AdaptiveGradientAccumulator: splits a micro-batch that runs out of memory and retries the rest.

step_batch(batch, loss_fn) runs the batch as ONE micro-batch of the window,
in chunks of at most `micro_batch_size` items. When a chunk raises
torch.OutOfMemoryError (in forward or backward), its partial gradients are
dropped, the chunk (and any queued chunk as large) is split in halves and
retried. Each chunk's gradient is weighted by its share of the micro-batch,
so the window's gradient is the same as without a split; the smaller size
is kept for later batches; at `min_micro_batch_size` the OOM is re-raised
as a RuntimeError that says so.

What the failed chunk had written is rolled back (window_sums.py). That is
exact, with no copy of anything, while the chunk's backward had only
written views that held nothing yet in this window (an OOM in forward
writes nothing at all). Once it had added to sums that earlier chunks or
micro-batches left, they are discarded, and the window's earlier
micro-batches are run again, at the new size, before the failed one is
retried from its first chunk (window_replay.py): the window's gradient is
the full batch's whichever chunk fails.

This follows Composer's device_train_microbatch_size="auto" (mosaicml/composer, composer/trainer/trainer.py),
with one difference that removes its DDP deadlock (Composer PR #2117): no
collective runs until the window's end, so ranks may split differently
without agreeing first. Under FSDP2/HSDP and DDP's "overlap" mode collectives
run inside micro-steps, so an OOM is re-raised at once as a clear error on
its rank instead of splitting alone and desynchronising the collectives; the
rank records it in the process group's store, and the others, whose
collectives then fail, raise PeerOutOfMemoryError naming it
(distributed/failures.py).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .accumulator import GradientAccumulator, LossFn
from .config import GradientAccumulationConfig
from .window import check_loss
from .window_replay import LoggedBatch, WindowLog


def batch_size_of(batch: Any) -> int:
    """Items along dim 0 of a tensor, or of every tensor in a (nested) tuple/list/dict; they must agree."""
    sizes = {t.shape[0] for t in _tensors(batch)}
    if len(sizes) != 1:
        raise ValueError(
            "AdaptiveGradientAccumulator: a batch must hold tensors that share their first dimension "
            f"(found sizes {sorted(sizes) if sizes else 'none'})"
        )
    return sizes.pop()


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch] if batch.dim() > 0 else []
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        return [t for v in batch for t in _tensors(v)]
    return []


def split_batch(batch: Any, size: int) -> list[Any]:
    """Splits every tensor of `batch` along dim 0 into chunks of `size` (the last may be smaller)."""
    total = batch_size_of(batch)
    return [_slice(batch, start, min(start + size, total)) for start in range(0, total, size)]


def _slice(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() > 0 else batch
    if isinstance(batch, Mapping):
        return type(batch)({k: _slice(v, start, stop) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_slice(v, start, stop) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_slice(v, start, stop) for v in batch)
    return batch


@dataclass(frozen=True)
class _Chunk:
    """Part of a micro-batch; replay: a micro-batch the window holds already, run again (it cannot close it)."""

    batch: LoggedBatch
    data: Any
    n: int
    replay: bool = False


def _chunks(batch: LoggedBatch, size: int, replay: bool = False) -> list[_Chunk]:
    parts = split_batch(batch.data, size) if size < batch.total else [batch.data]
    return [_Chunk(batch, part, batch_size_of(part), replay) for part in parts]


def _split(chunk: _Chunk, size: int) -> list[_Chunk]:
    return [_Chunk(chunk.batch, part, batch_size_of(part), chunk.replay) for part in split_batch(chunk.data, size)]


def check_split_sizes(micro_batch_size: int | None = None, min_micro_batch_size: int = 1) -> None:
    """micro_batch_size (None: the whole batch) and min_micro_batch_size must be integers >= 1."""
    for name, value, optional in (
        ("micro_batch_size", micro_batch_size, True),
        ("min_micro_batch_size", min_micro_batch_size, False),
    ):
        if (value is None and not optional) or (
            value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1)
        ):
            raise ValueError(f"AdaptiveGradientAccumulator: {name} must be an integer >= 1, got {value!r}")


class AdaptiveGradientAccumulator(GradientAccumulator):
    """GradientAccumulator whose step_batch() survives CUDA out-of-memory errors by splitting.

    AdaptiveGradientAccumulator(model_or_params, optimizer, config, scheduler=None, scaler=None, *,
    micro_batch_size=None, min_micro_batch_size=1), or AdaptiveGradientAccumulator(config, ...) and
    attach(model_or_params, optimizer, ...) later, as GradientAccumulator.
    micro_batch_size: the largest chunk to try first (None: the config's micro_batch_size, else the whole
    batch); it shrinks on OOM and stays shrunk. min_micro_batch_size: the floor.
    """

    def __init__(
        self,
        model_or_params: torch.nn.Module | Any | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        config: GradientAccumulationConfig | None = None,
        scheduler: Any | None = None,
        scaler: torch.amp.GradScaler | None = None,
        *,
        micro_batch_size: int | None = None,
        min_micro_batch_size: int = 1,
    ) -> None:
        check_split_sizes(micro_batch_size, min_micro_batch_size)
        super().__init__(model_or_params, optimizer, config, scheduler, scaler)
        self.micro_batch_size = micro_batch_size if micro_batch_size is not None else self.config.micro_batch_size
        self.min_micro_batch_size = min_micro_batch_size
        self.adaptation_history: list[dict[str, int]] = []
        self._log = WindowLog()  # the open window's micro-batches, to run again (window_replay.py)
        self._in_step_batch = self._window_lost = False

    def step_batch(self, batch: Any, loss_fn: LossFn) -> bool:
        """Run `batch` as one micro-batch: loss_fn(model, chunk) -> loss or (loss, num_items), per chunk.

        In "mean" mode without num_items, chunk losses are means and each chunk
        is weighted by its share of the batch's items; with num_items (or in
        "sum" mode) chunks are weighted by their num_items as usual.
        """
        current = LoggedBatch.of(batch, loss_fn, batch_size_of(batch), _tensors(batch))
        micro = self._window.micro  # micro-batches the window holds before this one
        steps_before = self.stats.micro_steps - micro  # the count without them (a replay counts them again)
        self._log.start(micro)
        queue = deque(_chunks(current, min(current.total, self.micro_batch_size or current.total)))
        closed, self._in_step_batch = False, True
        try:
            with self.micro_step():
                while queue:
                    chunk = queue.popleft()
                    last = not queue or queue[0].batch is not chunk.batch  # completes its micro-batch
                    try:
                        closed = self._run_chunk(chunk, last)
                    except torch.OutOfMemoryError as oom:
                        lost, self._window_lost = self._window_lost, False
                        half = self._split_size(oom, chunk.n, lost)
                        if not lost:  # the failed chunk and the ones still queued (as large) all get the new size
                            queue = deque(part for c in (chunk, *queue) for part in _split(c, half))
                            continue
                        earlier = self._log.earlier(micro, oom)  # raises when that cannot be exact
                        self.stats.micro_steps = steps_before
                        self.adaptation_history[-1]["replayed"] = micro
                        replays = [c for b in earlier for c in _chunks(b, half, replay=True)]
                        queue = deque([*replays, *_chunks(current, half)])
        finally:
            self._in_step_batch = self._window_lost = False
        if not closed:
            self._log.record(current)
        return closed

    def _split_size(self, oom: torch.OutOfMemoryError, n: int, lost: bool) -> int:
        """After an OOM at chunk size n: the halved size (kept), or the error that ends step_batch."""
        self._backprop.drop_grads()
        discarded = "; the open window was discarded" if lost else ""
        if not self._sync.splits_alone:
            raise RuntimeError(
                f"AdaptiveGradientAccumulator: out of memory at micro-batch size {n} under "
                f"{self._sync.name}, whose forward/backward run collectives, so this rank cannot split "
                "alone; the other ranks raise PeerOutOfMemoryError naming this rank when their collective "
                "fails (within about 30 s while this process lives: distributed/peer_watch.py; at once "
                "when it exits). Lower "
                "micro_batch_size (or use DDP with ddp_reduce='buffer', where ranks split independently)" + discarded
            ) from oom
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if n <= self.min_micro_batch_size:
            raise RuntimeError(
                f"AdaptiveGradientAccumulator: out of memory at micro-batch size {n}, which is the floor "
                f"(min_micro_batch_size={self.min_micro_batch_size}); reduce the model's memory use or "
                "lower the floor" + discarded
            ) from oom
        half = math.ceil(n / 2)
        self.adaptation_history.append({"window": self.stats.windows, "from": n, "to": half, "replayed": 0})
        self.micro_batch_size = half
        return half

    def _window_discarded(self, error: BaseException) -> None:
        if self._in_step_batch and isinstance(error, torch.OutOfMemoryError):
            self._window_lost = True  # step_batch runs the window's micro-batches again
        else:
            super()._window_discarded(error)

    def _run_chunk(self, chunk: _Chunk, last: bool) -> bool:
        # Each chunk casts the weights afresh, as its own micro-step would: chunks that shared autocast's cast
        # cache (one micro_step() region) lost weight gradients under FSDP2/HSDP (the seam matrix, tests/seams).
        torch.clear_autocast_cache()
        out = chunk.batch.loss_fn(self.module, chunk.data)
        loss, num_items = out if isinstance(out, tuple) else (out, None)
        check_loss(loss)
        # Without num_items, a mean loss over this chunk stands for n/total of the micro-batch's mean.
        share = chunk.n / chunk.batch.total
        return self._backward_into_window(loss, num_items, share=share, completes=last, may_close=not chunk.replay)

    def backward(self, loss: torch.Tensor, num_items: int | torch.Tensor | None = None) -> bool:
        closed = super().backward(loss, num_items)
        self._log.forget()  # this micro-batch cannot be run again
        return closed

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._log.forget()  # the loaded sums' micro-batches cannot be run again

    def get_adaptation_stats(self) -> dict[str, Any]:
        return {
            "micro_batch_size": self.micro_batch_size,
            "min_micro_batch_size": self.min_micro_batch_size,
            "oom_splits": len(self.adaptation_history),
            "adaptation_history": list(self.adaptation_history),
        }
