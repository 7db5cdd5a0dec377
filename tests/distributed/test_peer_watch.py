"""The peer watch and the OOM records without processes: a simulated store, a simulated NCCL abort.

CI has only gloo, which cannot abort a collective in flight; the NCCL path (abort the groups, the
blocked call raises PeerOutOfMemoryError in the main thread) is checked here with the process
group's calls replaced. A thread "parked in a collective" is a thread blocked in C (a lock)
called from a function whose code claims a file under torch/distributed, as c10d's all_reduce waits
on gloo.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from gradacc_ext import GradientAccumulationConfig
from gradacc_ext.distributed import failures, oom_records, peer_watch
from gradacc_ext.distributed.oom_records import GAVE_UP, HIT, RECOVERED, OOMRecord
from gradacc_ext.distributed.thread_activity import ThreadActivity

FAST = peer_watch.Timers(poll_s=0.01, stall_s=0.2, retry_s=0.2, grace_s=0.3)
_ns: dict = {"torch": torch}
exec(  # a collective's wait, as gloo's caller sits in c10d's Python code; and a long kernel called from there
    compile(
        "def collective_wait(gate):\n    gate.acquire()\n"
        "def computing_there(gate):\n    a = torch.randn(600, 600, dtype=torch.float64) / 30\n"
        "    while gate.locked():\n        torch.linalg.matrix_power(a, 64)\n",
        os.path.join("x", "torch", "distributed", "c.py"),
        "exec",
    ),
    _ns,
)
collective_wait, computing_there = _ns["collective_wait"], _ns["computing_there"]


class FakeStore:
    """The c10d store calls the records use."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def add(self, key: str, n: int) -> int:
        value = int(self.data.get(key, b"0")) + n
        self.data[key] = str(value).encode()
        return value

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> FakeStore:
    fake = FakeStore()
    monkeypatch.setattr(oom_records, "_store", lambda: fake)
    return fake


def test_peer_error_never_names_this_rank_and_a_recovered_peer_is_cleared(store, monkeypatch):
    monkeypatch.setattr(failures, "_me", lambda: 1)
    oom_records.write(1, HIT, "OutOfMemoryError: mine")  # this rank's own OOM, caught and retried
    assert failures._peer_error() is None  # the issue: "rank 1 ran out of memory, so this rank (rank 1) failed"
    oom_records.write(0, HIT, "OutOfMemoryError: rank 0's")
    error = failures._peer_error()
    assert error is not None
    assert "rank 0 ran out of memory and did not come back, so this rank (rank 1) failed" in str(error)
    oom_records.write(0, RECOVERED)
    assert failures._peer_error() is None  # a record does not outlive the recovery
    oom_records.write(2, HIT, "OutOfMemoryError: rank 2's")
    oom_records.write(3, GAVE_UP, "OutOfMemoryError: rank 3's")
    assert oom_records.peer_to_name(1) == OOMRecord(3, GAVE_UP, "OutOfMemoryError: rank 3's")  # gave up: the cause
    assert oom_records.peer_gave_up(3) is None and oom_records.peer_gave_up(1).rank == 3


def test_an_oom_after_this_ranks_first_collective_gives_up_at_once(store, monkeypatch):
    """Retrying is safe only while no collective of the call ran here (the groups' sequence numbers)."""
    counts = iter([5, 5, 7, 8])  # entry/exit of a call without a collective, then of one with one
    monkeypatch.setattr(failures, "collectives_issued", lambda: next(counts))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    for _ in range(2):
        with pytest.raises(torch.OutOfMemoryError), failures.told_to_peers(True):
            raise torch.OutOfMemoryError("injected")
    states = [store.get(f"{oom_records.PREFIX}event/{n}").decode().split("|")[1] for n in (1, 2, 3)]
    assert states == [HIT, RECOVERED, GAVE_UP]  # the second entry came back first, then gave up


def test_a_caught_oom_not_retried_within_the_retry_time_gives_up(store, monkeypatch):
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    watch = peer_watch.PeerWatch(lambda r: "")
    watch.rank = 1
    watch.out_of_memory("OutOfMemoryError: x", gave_up=False)
    now = time.monotonic()
    watch.look(now + FAST.retry_s / 2, FAST, nccl=False)
    assert oom_records.peer_gave_up(0) is None
    watch.look(now + FAST.retry_s * 2, FAST, nccl=False)
    assert oom_records.peer_gave_up(0) == OOMRecord(1, GAVE_UP, "OutOfMemoryError: x")
    watch.enter()  # it came back after all
    watch.exit()
    assert oom_records.peer_gave_up(0) is None


def look_until(watch: peer_watch.PeerWatch, seconds: float, nccl: bool) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        watch.look(time.monotonic(), FAST, nccl)
        time.sleep(FAST.poll_s)


def in_thread(watch: peer_watch.PeerWatch, body) -> tuple[threading.Thread, threading.Lock]:
    """A rank's thread inside accumulator work, running body(gate) until the test releases the gate."""
    gate = threading.Lock()
    gate.acquire()

    def run() -> None:
        watch.enter()
        try:
            body(gate)
        finally:
            watch.exit()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(0.05)
    return thread, gate


def own_wait(gate: threading.Lock) -> None:
    """Blocked in the rank's own code (its data pipeline, I/O), not in a collective."""
    gate.acquire()


@pytest.mark.parametrize(("body", "parked"), [(collective_wait, True), (own_wait, False), (computing_there, False)])
def test_a_thread_is_parked_only_waiting_in_collective_code_without_cpu(body, parked):
    watch = peer_watch.PeerWatch(lambda r: "")
    thread, gate = in_thread(watch, body)
    try:
        activity = ThreadActivity(thread.ident, spins=False)
        for _ in range(5):
            waited = activity.parked_for(time.monotonic())
            time.sleep(0.05)
    finally:
        gate.release()
        thread.join()
    assert (waited > 0.1) == parked, waited


def test_the_watch_acts_only_on_a_peer_that_gave_up_and_only_once_parked(store, monkeypatch, caplog):
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    watch = peer_watch.PeerWatch(lambda r: f"rank {r.rank} gave up")
    watch.rank, watch.mode = 0, "log"
    oom_records.write(1, HIT, "OutOfMemoryError: x")
    thread, gate = in_thread(watch, own_wait)  # asleep in its own code (its data pipeline)
    oom_records.write(1, GAVE_UP, "OutOfMemoryError: x")
    look_until(watch, 0.5, nccl=False)
    gate.release()
    thread.join()
    assert not caplog.records  # a peer that gave up, but this rank is not in a collective: left alone
    oom_records.write(1, RECOVERED)
    thread, gate = in_thread(watch, collective_wait)
    look_until(watch, 0.5, nccl=False)
    assert not caplog.records  # parked, but no peer gave up
    oom_records.write(1, GAVE_UP, "OutOfMemoryError: x")
    with caplog.at_level(logging.CRITICAL, logger="gradacc_ext.distributed.peer_watch"):
        look_until(watch, 0.5, nccl=False)
    gate.release()
    thread.join()
    assert len(caplog.records) == 1  # reported once ("log": no exit)
    assert "rank 1 gave up" in caplog.records[0].message and "(rank 0)" in caplog.records[0].message


def test_nccl_the_watch_aborts_the_groups_and_the_blocked_call_raises_naming_the_peer(store, monkeypatch):
    """The abort unblocks the waiting call, which raises; the default group and its store are gone by then, so the
    error comes from the record the watch kept, naming this rank as it was. The process is not ended."""
    monkeypatch.setattr(failures._watch, "rank", 0)
    monkeypatch.setattr(failures._watch, "mode", "end")
    monkeypatch.setattr(failures._watch, "aborted_for", None)
    monkeypatch.setattr(failures._watch, "delivered", None)
    monkeypatch.setattr(failures, "_me", lambda: failures._watch.rank)
    monkeypatch.setattr(failures, "collectives_issued", lambda: 0)
    monkeypatch.setattr(peer_watch.os, "_exit", lambda code: pytest.fail(f"os._exit({code})"))
    oom_records.write(1, GAVE_UP, "RuntimeError: out of memory at micro-batch size 2")
    blocked = threading.Lock()
    blocked.acquire()

    def abort() -> None:
        monkeypatch.setattr(oom_records, "_store", lambda: None)  # the store goes with the default group
        blocked.release()

    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", abort)
    raised: list[BaseException] = []

    def nccl_collective(gate: threading.Lock) -> None:
        try:
            with failures.told_to_peers(True):
                collective_wait(blocked)
                raise RuntimeError("NCCL communicator was aborted")
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            raised.append(error)

    thread, _ = in_thread(failures._watch, nccl_collective)
    look_until(failures._watch, 1.0, nccl=True)
    thread.join(5)
    assert len(raised) == 1 and isinstance(raised[0], failures.PeerOutOfMemoryError), raised
    assert "rank 1 ran out of memory and gave up the step, so this rank (rank 0) failed" in str(raised[0])
    assert failures._watch.delivered == OOMRecord(1, GAVE_UP, "RuntimeError: out of memory at micro-batch size 2")


def test_bad_settings_name_themselves(monkeypatch):
    with pytest.raises(ValueError, match=r"peer_watch must be one of \('end', 'log', 'off'\), got 'kill'"):
        GradientAccumulationConfig(accumulation_steps=2, peer_watch="kill")
    monkeypatch.setenv("GRADACC_PEER_WATCH_STALL_S", "-1")
    with pytest.raises(ValueError, match="GRADACC_PEER_WATCH_STALL_S must be a number of seconds > 0, got '-1'"):
        peer_watch.Timers.from_env()
