"""Whether a thread is parked in a collective, read from another thread without touching the parked one.

Gloo runs a collective on its own threads; the calling thread waits on a condition variable inside
torch's code: c10d's Python API (all_reduce, barrier, a Work's wait), FSDP's hooks, or, for DDP's
reducer, the autograd engine that calls it. Parked there, the thread's innermost Python frame stays
at one instruction and it uses no CPU time. A thread doing its own work fails one of the three
tests: its own forward moves between frames, a long kernel uses CPU time (on CPU the kernels run
on this thread or its OpenMP team), and a wait in the user's code (I/O, a sleep) is not in torch's
collective code.

NCCL collectives run on the GPU: the thread waits wherever it next synchronises (a host read), and a
CUDA synchronisation may spin. With `spins=True` only the first test applies.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from types import FrameType

# Where a thread waits for a collective: c10d and the wrappers (torch/distributed, torch/nn/parallel), and the
# autograd engine (DDP's reducer waits for its all-reduces in a callback at the end of the backward).
_COLLECTIVE_CODE = tuple(
    os.sep + os.path.join("torch", *parts) + os.sep for parts in (("distributed",), ("nn", "parallel"), ("autograd",))
)
_BUSY_SHARE = 0.05  # CPU time above this share of the wall time between two looks: the thread is working


def _where(frame: FrameType | None) -> tuple[object, int, bool] | None:
    if frame is None:
        return None
    return frame.f_code, frame.f_lasti, any(p in frame.f_code.co_filename for p in _COLLECTIVE_CODE)


def _cpu_seconds(ident: int) -> float | None:
    """The thread's CPU time, or None where the platform cannot say (then only the frame is judged)."""
    with contextlib.suppress(AttributeError, OSError, OverflowError):
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    return None


class ThreadActivity:
    """Looks at one thread now and then; parked_for() says for how long it has been parked."""

    def __init__(self, ident: int, spins: bool) -> None:
        self.ident, self.spins = ident, spins
        self._last: tuple[object, int, bool] | None = None
        self._cpu: float | None = None
        self._seen_at = 0.0
        self._parked_since: float | None = None

    def reset(self) -> None:
        self._last = self._cpu = self._parked_since = None

    def parked_for(self, now: float) -> float:
        """Seconds the thread has stayed parked up to `now`, judged from this look and the previous ones."""
        where = _where(sys._current_frames().get(self.ident))
        cpu = None if self.spins else _cpu_seconds(self.ident)
        busy = cpu is not None and self._cpu is not None and cpu - self._cpu > _BUSY_SHARE * (now - self._seen_at)
        in_collective_code = where is not None and (self.spins or where[2])
        if where is None or where != self._last or busy or not in_collective_code:
            self._parked_since = None
        elif self._parked_since is None:
            self._parked_since = self._seen_at  # parked since the previous look, which saw it at the same place
        self._last, self._cpu, self._seen_at = where, cpu, now
        return 0.0 if self._parked_since is None else now - self._parked_since
