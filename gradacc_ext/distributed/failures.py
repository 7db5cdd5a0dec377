"""A rank's out-of-memory error, told to the other ranks through the process group's store.

A rank that runs out of memory where collectives run (inside a micro-step
under FSDP2/HSDP and DDP "overlap", or before a DDP window end) leaves the
group: the others wait in a collective it never joins, and fail when the
process group's timeout ends it, or at once when its process exits (gloo:
"connection closed"). That error says nothing about the cause. So the OOM
rank records itself in the default process group's store (c10d; torchrun's
agent hosts it, so it outlives the rank) before its error leaves the
accumulator, and a rank whose micro-step, backward or window end fails reads
the record and raises PeerOutOfMemoryError naming that rank, chained to its
own error. With no record, a failure is raised unchanged.

The store is written only on these error paths, never per step; while a rank is inside such work a
daemon thread reads it every few seconds, so that a peer which ran out of memory and stays alive
ends this rank's wait within a bound, not at the process group's timeout (peer_watch.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from .peer_watch import PeerWatch

KEY = "gradacc_ext/out_of_memory"  # the first OOM rank's "rank|message"; torchrun makes a store per restart
_MAX_MESSAGE = 600  # a CUDA OOM message lists the allocator's state; the peers need its gist


class PeerOutOfMemoryError(RuntimeError):
    """Another rank ran out of memory, so this rank's collective failed (the chained error)."""


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (ValueError, RuntimeError, AttributeError):  # no process group, or a torch without the helper
        return None


def is_out_of_memory(error: BaseException) -> bool:
    """torch.OutOfMemoryError, or an error raised from one (AdaptiveGradientAccumulator's clear error)."""
    return isinstance(error, torch.OutOfMemoryError) or isinstance(error.__cause__, torch.OutOfMemoryError)


def _record(error: BaseException) -> None:
    store = _store()
    if store is None:
        return
    text = f"{dist.get_rank()}|{type(error).__name__}: {str(error)[:_MAX_MESSAGE]}"
    with contextlib.suppress(RuntimeError):  # store unreachable: this rank's own error is raised anyway
        store.compare_set(KEY, "", text)  # the first OOM rank is kept: the others failed after it


def _read_record() -> tuple[int, str] | None:
    """The first out-of-memory rank and its message, or None (no record, no store, or its host is gone)."""
    store = _store()
    if store is None:
        return None
    try:
        if not store.check([KEY]):
            return None
        rank, message = store.get(KEY).decode().split("|", 1)
    except RuntimeError:  # the store's host is gone (e.g. it was the OOM rank's process): nothing to tell
        return None
    return int(rank), message


def _explain(record: tuple[int, str] | None = None) -> str:
    rank, message = record or _read_record() or (-1, "(the record is gone)")
    me = dist.get_rank() if dist.is_initialized() else _watch.rank  # after the watch's abort: the kept rank
    return (
        f"GradientAccumulator: rank {rank} ran out of memory, so this rank (rank {me}) failed in a "
        f"collective that rank {rank} never joined (that failure is chained as this error's cause). "
        f"Rank {rank} raised: {message}\n"
        "Lower the memory per rank: a smaller micro-batch (AdaptiveGradientAccumulator: micro_batch_size), "
        "fsdp_reduce='micro_step' (FSDP2 keeps 1/world of the gradient between micro-steps, not a full one), or "
        "DDP with ddp_reduce='buffer', where an AdaptiveGradientAccumulator rank splits its micro-batch alone"
    )


def _peer_error() -> PeerOutOfMemoryError | None:
    record = _read_record() or _watch.aborted_for  # the watch's abort takes the default store with the groups
    if record is None:
        return None
    _watch.delivered = record  # told to the caller: the watch stands down for it
    return PeerOutOfMemoryError(_explain(record))


_watch = PeerWatch(_read_record, _explain)


@contextlib.contextmanager
def told_to_peers(distributed: bool) -> Iterator[None]:
    """Around accumulator work that can meet a collective: records this rank's OOM, names a peer's OOM."""
    if distributed:
        _watch.enter()  # bounds a wait on a peer that ran out of memory and stays alive (peer_watch.py)
    try:
        yield
    except Exception as error:
        if not distributed or isinstance(error, PeerOutOfMemoryError):
            raise
        if is_out_of_memory(error):
            _record(error)
            raise
        peer = _peer_error()
        if peer is None:
            raise
        raise peer from error
    finally:
        if distributed:
            _watch.exit()
