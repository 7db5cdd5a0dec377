"""A bound on how long a rank waits for a peer that ran out of memory and stayed alive.

A rank that runs out of memory where collectives run records itself in the c10d store
(failures.py) and raises. When its process exits, the others' collectives fail at once; when it
stays alive (the script catches the error, or saves and cleans up first), they wait inside the
collective it never joins until the process group's timeout, by default many minutes.

So each data-parallel rank runs one daemon thread that, only while this rank is inside accumulator
work that meets collectives (failures.told_to_peers), reads the store every POLL_S seconds (a
store read, not a collective: nothing is added per micro-step). When a peer's out-of-memory record
is there and this rank's work has not moved on for STALL_S seconds since, the rank is stuck in a
collective that cannot complete. The thread then aborts this rank's process groups (NCCL unblocks
the waiting call, which raises PeerOutOfMemoryError naming the peer); if the call is still blocked
ABORT_GRACE_S later (gloo cannot abort a collective in flight), it writes that error to stderr and
ends the process with EXIT_CODE, as NCCL's watchdog takes a process down on a collective timeout.
From the peer's record to the error: at most POLL_S + STALL_S + ABORT_GRACE_S (27 s by default).

A healthy rank never waits on it: the thread only reads the store, and only while a record of a
peer's out-of-memory error exists is anything done. GRADACC_PEER_WATCH=0 turns the thread off;
GRADACC_PEER_WATCH_POLL_S / _STALL_S / _GRACE_S change the times.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

EXIT_CODE = 75  # EX_TEMPFAIL: a restart (torchrun --max-restarts) may succeed with less memory per rank


def _seconds(name: str, default: float) -> float:
    return float(os.environ.get(f"GRADACC_PEER_WATCH_{name}", default))


POLL_S = _seconds("POLL_S", 2.0)
STALL_S = _seconds("STALL_S", 20.0)
ABORT_GRACE_S = _seconds("GRACE_S", 5.0)


class PeerWatch:
    """Counts this rank's entries into collective-bearing work; its thread ends a wait no peer will end."""

    def __init__(self, read_record: Callable[[], tuple[int, str] | None], explain: Callable[[], str]) -> None:
        """read_record: the first out-of-memory rank and its message from the store, or None;
        explain: the PeerOutOfMemoryError message for it."""
        self._read_record, self._explain = read_record, explain
        self._lock = threading.Lock()
        self._depth = 0  # how deep this rank is in told_to_peers (nested: micro_step, then backward)
        self._entries = 0  # entries so far: a rank that moves on changes it
        self.delivered: tuple[int, str] | None = None  # the record a PeerOutOfMemoryError already reported
        self.aborted_for: tuple[int, str] | None = None  # the record the groups were aborted for (store gone since)
        self.rank = -1  # this rank, kept: an aborted default group can no longer say it
        self._thread: threading.Thread | None = None

    def enter(self) -> None:
        with self._lock:
            self._depth += 1
            self._entries += 1
            if self._thread is None and dist.is_initialized() and os.environ.get("GRADACC_PEER_WATCH", "1") != "0":
                self.rank = dist.get_rank()
                self._thread = threading.Thread(target=self._run, name="gradacc-peer-watch", daemon=True)
                self._thread.start()

    def exit(self) -> None:
        with self._lock:
            self._depth -= 1

    def _position(self) -> int | None:
        """Which entry this rank is inside, or None when it is outside collective-bearing work."""
        with self._lock:
            return self._entries if self._depth else None

    def _stuck_peer_record(self, rank: int) -> tuple[int, str] | None:
        record = self._read_record()
        return None if record is None or record == self.delivered or record[0] == rank else record

    def _run(self) -> None:
        seen: tuple[int, float] | None = None  # (position, time) when a peer's record was first seen there
        while True:
            time.sleep(POLL_S)
            position = self._position()
            record = self._stuck_peer_record(self.rank) if position is not None else None
            if record is None:
                seen = None
                continue
            if seen is None or seen[0] != position:
                seen = (position, time.monotonic())
                continue
            if time.monotonic() - seen[1] < STALL_S:
                continue
            self._end_the_wait(position, record)
            seen = None

    def _end_the_wait(self, position: int, record: tuple[int, str]) -> None:
        explanation = self._explain()  # before the abort, which takes the default store with it
        self.aborted_for = record  # for the PeerOutOfMemoryError the unblocked call raises
        with contextlib.suppress(Exception):  # NCCL: unblocks the call; gloo: nothing to abort in flight
            dist.distributed_c10d._abort_process_group()
        time.sleep(ABORT_GRACE_S)
        if self._position() != position:
            return  # the call raised (PeerOutOfMemoryError): the caller has the error
        sys.stderr.write(
            f"gradacc_ext.PeerOutOfMemoryError: {explanation}\n"
            f"This rank waited {STALL_S:.0f} s in a collective that rank cannot join; ending the process "
            f"(exit code {EXIT_CODE}) rather than waiting for the process group's timeout.\n"
        )
        sys.stderr.flush()
        os._exit(EXIT_CODE)
