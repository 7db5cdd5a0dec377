"""Each rank's out-of-memory state, kept in the default process group's c10d store for the other ranks.

A rank that runs out of memory inside accumulator work is in one of two states:
  hit      it raised an OOM before running any collective of that call: the others are not
           desynchronised, and the rank may catch the error and retry (DDP "buffer" mode);
  gave_up  it will not join the collectives the others wait in: its OOM came after its first
           collective of that call, or it caught an OOM and did not come back within the
           retry time (peer_watch.py).
A rank that comes back into accumulator work after a "hit" writes "recovered", which clears it.

The store only grows, so the log is append-only: `count` is a counter (store.add) and event n is
`event/n` = "rank|state|message"; a rank's latest event is its state. Written only on these error
and retry paths, never per step; read when a collective failed, or by the watch of a rank that has
been parked in a collective for the stall time. torchrun makes a fresh store per restart.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch.distributed as dist

PREFIX = "gradacc_ext/out_of_memory/"
HIT, GAVE_UP, RECOVERED = "hit", "gave_up", "recovered"
_MAX_MESSAGE = 600  # a CUDA OOM message lists the allocator's state; the peers need its gist


class OOMRecord(NamedTuple):
    rank: int
    state: str  # HIT or GAVE_UP (a recovered rank has no record)
    message: str  # the OOM rank's "Type: message"


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (ValueError, RuntimeError, AttributeError):  # no process group, or a torch without the helper
        return None


def write(rank: int, state: str, message: str = "") -> None:
    """Appends this rank's new state; a missing or unreachable store is skipped (the rank's own error goes on)."""
    store = _store()
    if store is None:
        return
    with contextlib.suppress(RuntimeError):
        n = store.add(PREFIX + "count", 1)
        store.set(f"{PREFIX}event/{n}", f"{rank}|{state}|{message[:_MAX_MESSAGE]}")


def _latest() -> list[OOMRecord]:
    """Every rank whose latest state is HIT or GAVE_UP, in the order of its first event in that state."""
    store = _store()
    if store is None:
        return []
    try:
        count = store.add(PREFIX + "count", 0)  # one round trip; 0 on a healthy run
        events = [store.get(f"{PREFIX}event/{n}").decode().split("|", 2) for n in range(1, count + 1)]
    except RuntimeError:  # the store's host is gone (e.g. it was the OOM rank's process): nothing to tell
        return []
    latest: dict[int, OOMRecord] = {}
    for rank, state, message in events:
        if state == RECOVERED:
            latest.pop(int(rank), None)
        elif int(rank) not in latest or latest[int(rank)].state != state:
            latest.pop(int(rank), None)  # re-inserted: ordered by when it entered this state
            latest[int(rank)] = OOMRecord(int(rank), state, message)
    return list(latest.values())


def peer_gave_up(me: int) -> OOMRecord | None:
    """The first other rank that gave up the step, or None."""
    return next((r for r in _latest() if r.state == GAVE_UP and r.rank != me), None)


def peer_to_name(me: int) -> OOMRecord | None:
    """For a failed collective: the first other rank that gave up, else the first other that hit an OOM and has
    not come back (its process may have ended). Never this rank: its own OOM is its own error, not the cause."""
    records = [r for r in _latest() if r.rank != me]
    return next((r for r in records if r.state == GAVE_UP), None) or next(iter(records), None)
