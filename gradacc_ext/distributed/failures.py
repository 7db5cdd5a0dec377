"""A rank's out-of-memory error, told to the other ranks through the process group's store.

A rank that runs out of memory where collectives run leaves the group: the others wait in a
collective it never joins, and fail when the process group's timeout ends it, or at once when its
process exits (gloo: "connection closed"). That error says nothing about the cause. So an OOM
leaving a rank's micro_step(), backward() or flush() is recorded in the default process group's
store (oom_records.py; torchrun's agent hosts it, so it outlives the rank) before it leaves the
accumulator, and a rank whose call fails reads the record and raises PeerOutOfMemoryError naming
that rank (never itself), chained to its own error. With no record, a failure is raised unchanged.

The record says whether the rank may still come back. Its OOM came before any collective of that
call ran on it (the process groups' sequence numbers did not move): the others are not
desynchronised, and the rank may catch the error and retry, which clears the record (DDP
"buffer" mode: no collective runs inside a micro-step). Otherwise it gave up the step. A peer
that gave up and stays alive ends this rank's wait within a bound (peer_watch.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from . import oom_records
from .oom_records import GAVE_UP, OOMRecord
from .peer_watch import PeerWatch


class PeerOutOfMemoryError(RuntimeError):
    """Another rank ran out of memory, so this rank's collective failed (the chained error)."""


def is_out_of_memory(error: BaseException) -> bool:
    """torch.OutOfMemoryError, or an error raised from one (AdaptiveGradientAccumulator's clear error)."""
    return isinstance(error, torch.OutOfMemoryError) or isinstance(error.__cause__, torch.OutOfMemoryError)


def collectives_issued() -> int | None:
    """Collectives this rank has issued on all its process groups so far, or None where torch cannot say."""
    try:
        return sum(group._get_sequence_number_for_group() for group in dist.distributed_c10d._world.pg_map)
    except (AttributeError, RuntimeError):
        return None


def _me() -> int:
    return dist.get_rank() if dist.is_initialized() else _watch.rank  # after the watch's abort: the kept rank


def _explain(record: OOMRecord) -> str:
    rank, me = record.rank, _me()
    why = "gave up the step" if record.state == GAVE_UP else "did not come back"
    return (
        f"GradientAccumulator: rank {rank} ran out of memory and {why}, so this rank (rank {me}) failed in a "
        f"collective that rank {rank} never joined (that failure is chained as this error's cause). "
        f"Rank {rank} raised: {record.message}\n"
        "Lower the memory per rank: a smaller micro-batch (AdaptiveGradientAccumulator: micro_batch_size), "
        "fsdp_reduce='micro_step' (FSDP2 keeps 1/world of the gradient between micro-steps, not a full one), or "
        "DDP with ddp_reduce='buffer', where no collective runs inside a micro-step: an AdaptiveGradientAccumulator "
        "rank splits its micro-batch alone there, and a rank that catches an OOM from micro_step() may retry it "
        "(docs/distributed.md)"
    )


def _peer_error() -> PeerOutOfMemoryError | None:
    # The watch's abort takes the default store with the groups: then the record it kept.
    record = oom_records.peer_to_name(_me()) or _watch.aborted_for
    if record is None:
        return None
    _watch.delivered = record  # told to the caller: the watch stands down for it
    return PeerOutOfMemoryError(_explain(record))


_watch = PeerWatch(_explain)


def watch_peers(mode: str) -> None:
    """GradientAccumulationConfig.peer_watch of a data-parallel accumulator: "end", "log" or "off" (peer_watch.py)."""
    _watch.mode = mode


@contextlib.contextmanager
def told_to_peers(distributed: bool) -> Iterator[None]:
    """Around accumulator work that can meet a collective: records this rank's OOM, names a peer's OOM."""
    if not distributed:
        yield
        return
    _watch.enter()  # a rank coming back after a caught OOM clears its record here
    issued = collectives_issued()
    try:
        yield
    except Exception as error:
        if isinstance(error, PeerOutOfMemoryError):
            raise
        if is_out_of_memory(error):
            after = collectives_issued()
            # Unknown counts (an older torch): a "hit", which the watch's retry time turns into a give-up.
            gave_up = None not in (issued, after) and after != issued
            _watch.out_of_memory(f"{type(error).__name__}: {error}", gave_up)
            raise
        peer = _peer_error()
        if peer is None:
            raise
        raise peer from error
    finally:
        _watch.exit()
