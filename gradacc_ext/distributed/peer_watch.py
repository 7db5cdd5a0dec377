"""A bound on how long a rank waits in a collective for a peer that gave up the step and stayed alive.

A rank whose OOM leaves accumulator work records it in the c10d store (oom_records.py). When its
process exits, the others' collectives fail at once. When it stays alive, two cases differ:
  - it caught the OOM and retries (enters micro_step()/backward()/flush() again): supported where no
    collective of that call had run on it yet (DDP "buffer" mode: none runs inside a micro-step). Its
    return clears the record; the others were never desynchronised and are left alone, however slow
    any rank is afterwards;
  - it gave up the step: its OOM came after its first collective of the call, or it has not come back
    within RETRY_S. The others would wait inside a collective it never joins until the process
    group's timeout, by default many minutes.

So each data-parallel rank runs one daemon thread that looks every POLL_S at the thread inside
accumulator work (failures.told_to_peers). Only once that thread has been parked in a collective
for STALL_S (thread_activity.py: not while it runs its own forward, backward or window end) does it
read the store, and only if a peer gave up does it act: NCCL: abort the process groups, so that
the blocked call raises PeerOutOfMemoryError naming the peer in the main thread; gloo, which cannot
abort a collective in flight (or an NCCL call still blocked GRACE_S after the abort): report that
error through logging and on stderr and, with peer_watch="end" (the default), end the process with
EXIT_CODE, as NCCL's watchdog takes a process down on a collective timeout (os._exit: no `finally`,
no atexit). peer_watch="log" only reports and leaves the wait to the group's timeout.
Bound from the peer's OOM to the report: RETRY_S + 2 POLL_S (+ GRACE_S after an NCCL abort), 24 s
by default, when this rank is already parked; else STALL_S after it parks.

GradientAccumulationConfig(peer_watch="off") or GRADACC_PEER_WATCH=0 turns the thread off;
GRADACC_PEER_WATCH_POLL_S / _STALL_S / _RETRY_S / _GRACE_S change the times (read when it starts).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import torch.distributed as dist

from . import oom_records
from .oom_records import GAVE_UP, HIT, RECOVERED, OOMRecord
from .thread_activity import ThreadActivity

EXIT_CODE = 75  # EX_TEMPFAIL: a restart (torchrun --max-restarts) may succeed with less memory per rank
MODES = ("end", "log", "off")
logger = logging.getLogger(__name__)


class Timers(NamedTuple):
    poll_s: float = 2.0
    stall_s: float = 20.0
    retry_s: float = 20.0
    grace_s: float = 5.0

    @classmethod
    def from_env(cls) -> Timers:
        values = []
        for field, default in zip(cls._fields, cls._field_defaults.values(), strict=True):
            name = f"GRADACC_PEER_WATCH_{field.upper()}"
            text = os.environ.get(name, str(default))
            try:
                value = float(text)
            except ValueError:
                value = math.nan
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a number of seconds > 0, got {text!r}")
            values.append(value)
        return cls(*values)


def _report(message: str) -> None:
    logger.critical(message)
    if logger.hasHandlers():  # without handlers, logging's last resort has written it to stderr already
        sys.stderr.write(message + "\n")
        sys.stderr.flush()


class PeerWatch:
    """Tracks this rank's accumulator work and its own OOM state; its thread ends a wait no peer will end."""

    def __init__(self, explain: Callable[[OOMRecord], str]) -> None:
        """explain: the PeerOutOfMemoryError message for a peer's record."""
        self._explain = explain
        self._lock = threading.Lock()
        self._depth = 0  # how deep this rank is in told_to_peers
        self._entries = 0  # entries so far: a rank that moves on changes it
        self._ident = 0  # the thread inside accumulator work
        self._own: tuple[str, float, str] | None = None  # this rank's OOM: HIT (or GAVE_UP by the timer), when, what
        self.mode = "end"  # GradientAccumulationConfig.peer_watch of the last data-parallel accumulator built
        self.delivered: OOMRecord | None = None  # the record a PeerOutOfMemoryError already reported
        self.aborted_for: OOMRecord | None = None  # the record the groups were aborted for (store gone since)
        self.rank = -1  # this rank, kept: an aborted default group can no longer say it
        self._thread: threading.Thread | None = None
        self._activity: tuple[tuple[int, int], ThreadActivity] | None = None  # the entry looked at, and its thread

    def enter(self) -> None:
        with self._lock:
            if self._thread is None and self._wanted():
                timers = Timers.from_env()  # a bad setting raises here, before anything changed
                self.rank, nccl = dist.get_rank(), "nccl" in str(dist.get_backend())
                self._thread = threading.Thread(target=self._run, args=(timers, nccl), name="gradacc-peer-watch")
                self._thread.daemon = True
                self._thread.start()
            self._depth += 1
            self._entries += 1
            self._ident = threading.get_ident()
            came_back, self._own = self._own is not None, None
        if came_back:  # retrying after a caught OOM: the peers are not waiting for this rank any more
            oom_records.write(dist.get_rank(), RECOVERED)

    def exit(self) -> None:
        with self._lock:
            self._depth -= 1

    def out_of_memory(self, message: str, gave_up: bool) -> None:
        """This rank's OOM leaves accumulator work: gave_up when it came after a collective of that call."""
        with self._lock:
            self._own = None if gave_up else (HIT, time.monotonic(), message)  # a give-up is final: nothing clears it
        oom_records.write(dist.get_rank(), GAVE_UP if gave_up else HIT, message)

    def _wanted(self) -> bool:
        return dist.is_initialized() and self.mode != "off" and os.environ.get("GRADACC_PEER_WATCH", "1") != "0"

    def _position(self) -> tuple[int, int] | None:
        """(entry, thread) this rank is inside, or None when it is outside accumulator work."""
        with self._lock:
            return (self._entries, self._ident) if self._depth else None

    def _give_up_if_not_back(self, now: float, retry_s: float) -> None:
        with self._lock:
            own, outside = self._own, not self._depth
            late = own is not None and own[0] == HIT and outside and now - own[1] >= retry_s
            if late:
                self._own = (GAVE_UP, now, own[2])  # cleared if it still comes back
        if late:
            oom_records.write(self.rank, GAVE_UP, own[2])

    def _run(self, timers: Timers, nccl: bool) -> None:
        while True:
            time.sleep(timers.poll_s)
            if self.mode != "off":
                self.look(time.monotonic(), timers, nccl)

    def look(self, now: float, timers: Timers, nccl: bool) -> None:
        """One look (the thread's, every POLL_S): gives this rank up if it did not come back after its OOM; acts when
        the thread inside accumulator work has been parked for STALL_S and a peer gave up."""
        self._give_up_if_not_back(now, timers.retry_s)
        position = self._position()
        if position is None:
            self._activity = None
            return
        if self._activity is None or self._activity[0] != position:  # a new entry: judge its thread afresh
            self._activity = (position, ThreadActivity(position[1], spins=nccl))  # a CUDA sync may spin
        if self._activity[1].parked_for(now) < timers.stall_s:
            return
        record = oom_records.peer_gave_up(self.rank)  # the store, only once parked for the stall time
        if record is not None and record != self.delivered:
            self._end_the_wait(position, record, timers, nccl)

    def _end_the_wait(self, position: tuple[int, int], record: OOMRecord, timers: Timers, nccl: bool) -> None:
        explanation = self._explain(record)  # before an abort, which takes the default store with it
        if nccl:  # the abort unblocks the call, which raises PeerOutOfMemoryError (failures.py)
            self.aborted_for = record
            with contextlib.suppress(Exception):
                dist.distributed_c10d._abort_process_group()
            time.sleep(timers.grace_s)
            if self._position() != position:
                return
        ending = self.mode == "end"
        _report(
            f"gradacc_ext.PeerOutOfMemoryError: {explanation}\n"
            f"This rank (rank {self.rank}) has been parked for {timers.stall_s:g} s or more in a collective that "
            f"rank {record.rank} will not join; "
            + (
                f"ending the process (exit code {EXIT_CODE}) rather than waiting for the process group's timeout "
                "(GradientAccumulationConfig(peer_watch='log') only reports this)."
                if ending
                else "waiting for the process group's timeout (peer_watch='log')."
            )
        )
        if ending:
            logging.shutdown()  # flush the handlers: os._exit skips atexit
            os._exit(EXIT_CODE)
        self.delivered = record  # reported once
