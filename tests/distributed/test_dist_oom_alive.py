"""A rank runs out of memory, gives up the step and stays alive: its peer learns of it within 60 s, naming it.

Real gloo processes, the store hosted apart (as torchrun's agent does). The process group the
model runs on has a 150 s timeout, past the bound: without the peer watch
(gradacc_ext/distributed/peer_watch.py) rank 0 would wait there for all of it. Gloo cannot abort a
collective in flight, so the watch ends rank 0's process with its exit code and the
PeerOutOfMemoryError text on stderr and through logging, while rank 1 stays alive; with
peer_watch="log" it only reports, and rank 0 raises PeerOutOfMemoryError at the group's timeout.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _dist import (
    _entry,
    _host_store,
    free_port,
    fsdp_model,
    global_batches,
    loss_and_items,
    make_model,
    make_optimizer,
    needs_gloo,
    shard,
)
from test_dist_oom import adaptive, oom_in_step_batch
from test_dist_oom_retry import SHORT, shorten_timers
from torch.distributed.device_mesh import DeviceMesh

from gradacc_ext import GradientAccumulationConfig, GradientAccumulator, PeerOutOfMemoryError
from gradacc_ext.distributed import peer_watch

pytestmark = [pytest.mark.distributed, needs_gloo]
BOUND = 60  # seconds from the start to rank 0's end (the issue's bound); the defaults give about 24 + start-up
GROUP_TIMEOUT = 150  # the model's process group: past the bound, so only the watch can end the wait in time
SEED = 31


def keep_rank0_output(log_dir: str) -> None:
    """Rank 0's fd 2 (the watch writes there before os._exit) and its gradacc_ext log go to files for the test."""
    err = os.open(os.path.join(log_dir, "rank0.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    logging.getLogger("gradacc_ext").addHandler(logging.FileHandler(os.path.join(log_dir, "rank0.log")))


def run_live(worker: Callable, log_dir: Path, *args) -> tuple[int | None, float, bool]:
    """Runs 2 ranks of worker(rank, world, log_dir, *args); returns rank 0's exit code, its time from the start,
    and whether rank 1 was still alive then (it sleeps past the bound: the test ends it)."""
    world, port = 2, free_port()
    ctx = mp.get_context("fork")
    host = ctx.Process(target=_host_store, args=(port, world), daemon=True)
    host.start()
    start = time.monotonic()
    worker_args = (str(log_dir), *args)
    ranks = [ctx.Process(target=_entry, args=(r, world, port, worker, worker_args, True)) for r in range(world)]
    try:
        for p in ranks:
            p.start()
        ranks[0].join(BOUND)
        elapsed = time.monotonic() - start
        ranks[1].join(0.1)
        alive = ranks[1].is_alive()
    finally:
        for p in (*ranks, host):
            if p.is_alive():
                p.kill()
            p.join()
    return ranks[0].exitcode, elapsed, alive


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def worker(rank: int, world: int, log_dir: str) -> None:
    if rank == 0:
        keep_rank0_output(log_dir)
    group = dist.new_group(timeout=timedelta(seconds=GROUP_TIMEOUT))
    acc = adaptive(fsdp_model(DeviceMesh.from_group(group, "cpu")))
    run = oom_in_step_batch(acc, rank, world, 1)  # rank 1 runs out of memory in its 2nd micro-batch
    if rank == 1:
        with pytest.raises(RuntimeError, match="out of memory at micro-batch size 2 under fsdp"):
            run()
        time.sleep(BOUND + 30)  # alive, holding every connection (the test ends this process)
        os._exit(0)
    run()  # blocks in a collective rank 1 never joins, until the watch ends this process
    os._exit(3)  # not reached


def test_peer_of_a_live_oom_rank_learns_within_the_bound(tmp_path: Path):
    """FSDP2, the default timers: rank 1 raises the adaptive accumulator's error and never comes back."""
    exitcode, elapsed, alive = run_live(worker, tmp_path)
    err = read(tmp_path / "rank0.err")
    assert exitcode == peer_watch.EXIT_CODE, (exitcode, elapsed, err[-2000:])
    assert elapsed < BOUND
    assert "gradacc_ext.PeerOutOfMemoryError: GradientAccumulator: rank 1 ran out of memory" in err, err[-2000:]
    assert "so this rank (rank 0) failed" in err
    assert "Rank 1 raised: RuntimeError: AdaptiveGradientAccumulator: out of memory" in err
    assert err.strip() in read(tmp_path / "rank0.log")  # the same report through logging
    assert alive  # rank 1 stayed alive throughout
    print(f"rank 0 ended after {elapsed:.1f} s (bound {BOUND} s, group timeout {GROUP_TIMEOUT} s)")


def abandoning_worker(rank: int, world: int, log_dir: str, mode: str, group_timeout: float, reduce: str) -> None:
    """DDP "buffer": rank 0 catches an OOM and retries it (its record is cleared); rank 1 catches one and never
    comes back. Rank 0 then runs a slow micro-step of its own, long past the stall and retry times, before it
    parks in the window end's all-reduce ("overlap": in DDP's reducer, inside the closing backward): the watch
    may act only there."""
    shorten_timers(SHORT)
    if rank == 0:
        keep_rank0_output(log_dir)
    model = torch.nn.parallel.DistributedDataParallel(
        make_model(), process_group=dist.new_group(timeout=timedelta(seconds=group_timeout))
    )
    cfg = GradientAccumulationConfig(accumulation_steps=3, peer_watch=mode, ddp_reduce=reduce)
    acc = GradientAccumulator(model, make_optimizer(model.parameters()), cfg)
    for i, batch in enumerate(global_batches("mean", world, SEED)[:3]):
        part = shard(batch, rank)
        if i == 1:
            dist.barrier()  # rank 0's OOM is recorded before rank 1's (today's store kept only the first)
        if (rank, i) in ((0, 0), (1, 1)):
            with pytest.raises(torch.OutOfMemoryError), acc.micro_step():
                raise torch.OutOfMemoryError(f"injected on rank {rank}")
            if rank == 1:  # gives up, alive, holding every connection (the test ends this process)
                time.sleep(BOUND + 30)
        with acc.micro_step():
            if i == 2:
                time.sleep(3.0)  # rank 0's own slow forward: not parked in a collective
                Path(log_dir, "forward_done").touch()
            acc.backward(loss_and_items(model, part)[0])  # closes the window: the all-reduce rank 1 never joins
    os._exit(4)  # not reached: "end" ends the process, "log" raises at the group's timeout


def logging_worker(rank: int, world: int, log_dir: str) -> None:
    with pytest.raises(PeerOutOfMemoryError) as info:
        abandoning_worker(rank, world, log_dir, "log", 10, "buffer")
    Path(log_dir, "raised").write_text(str(info.value))
    os._exit(0)


@pytest.mark.parametrize("reduce", ["buffer", "overlap"])
def test_abandoned_ddp_peer_ends_this_rank_only_once_parked_naming_the_peer(tmp_path: Path, reduce: str):
    exitcode, elapsed, alive = run_live(abandoning_worker, tmp_path, "end", GROUP_TIMEOUT, reduce)
    err = read(tmp_path / "rank0.err")
    assert exitcode == peer_watch.EXIT_CODE, (exitcode, elapsed, err[-2000:])
    assert elapsed < BOUND
    assert (tmp_path / "forward_done").exists()  # not ended during its own 3 s forward
    assert "rank 1 ran out of memory and gave up the step, so this rank (rank 0) failed" in err, err[-2000:]
    assert "Rank 1 raised: OutOfMemoryError: injected on rank 1" in err
    assert err.strip() in read(tmp_path / "rank0.log")
    assert alive
    print(f"rank 0 ended after {elapsed:.1f} s (its own 3 s forward, stall 0.5 s, group timeout {GROUP_TIMEOUT} s)")


def test_peer_watch_log_only_reports_and_the_group_timeout_raises_naming_the_peer(tmp_path: Path):
    exitcode, elapsed, alive = run_live(logging_worker, tmp_path)
    log = read(tmp_path / "rank0.log")
    assert exitcode == 0, (exitcode, elapsed, read(tmp_path / "rank0.err")[-2000:])
    assert "rank 1 ran out of memory and gave up the step, so this rank (rank 0)" in log
    assert "waiting for the process group's timeout (peer_watch='log')" in log
    assert "rank 1 ran out of memory and gave up the step, so this rank (rank 0)" in read(tmp_path / "raised")
    assert alive
