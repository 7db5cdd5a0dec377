"""One rank runs out of memory where collectives run: every rank raises a clear error naming it, in bounded time.

Real gloo processes. A torch.OutOfMemoryError is injected into one rank's
loss_fn (or backward). AdaptiveGradientAccumulator re-raises it at once as a
clear error, since under FSDP2/HSDP and DDP "overlap" it cannot split alone;
a plain GradientAccumulator (DDP "buffer", FSDP2 without micro_step()) lets
the OOM itself out. The other
ranks' collectives then fail, at once when the OOM rank's process exits
(the store hosted by the launcher, as torchrun's agent does) or at a short
group timeout while it stays alive, and they raise PeerOutOfMemoryError
naming that rank. A failure that is not an OOM keeps its own error.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _dist import (
    MICRO,
    STEPS,
    fsdp_model,
    global_batches,
    launch,
    loss_and_items,
    make_model,
    make_optimizer,
    needs_gloo,
    shard,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gradacc_ext import (
    AdaptiveGradientAccumulator,
    GradientAccumulationConfig,
    GradientAccumulator,
    PeerOutOfMemoryError,
)

pytestmark = [pytest.mark.distributed, needs_gloo]
SEED = 17
GROUP_TIMEOUT = 3  # seconds: the collectives a live OOM rank abandons fail this fast (the default group has 60)
BOUND = 25  # seconds any rank may take to raise beyond that, on a loaded 2-core machine
ADAPTIVE = r"RuntimeError: AdaptiveGradientAccumulator: out of memory at micro-batch size 2 under {}, .*cannot split"


def failing_loss(fail_rank: int, at: int, rank: int, error: Exception):
    """loss_fn that raises `error` on rank `fail_rank` at its call number `at` (0-based), once."""
    calls = [0]

    def loss_fn(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        calls[0] += 1
        if rank == fail_rank and calls[0] == at + 1:
            raise error
        return loss_and_items(model, batch)[0]

    return loss_fn


def run_until_error(acc: GradientAccumulator, rank: int, world: int, loss_fn) -> None:
    for batch in global_batches("mean", world, SEED):
        acc.step_batch(shard(batch, rank), loss_fn)
    acc.flush()


class OOMInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("injected in backward")


def backward_outside_micro_step(acc: GradientAccumulator, rank: int, world: int, oom_rank: int) -> None:
    """FSDP2 needs no micro_step(): rank `oom_rank` runs out of memory in its 2nd backward."""
    for i, batch in enumerate(global_batches("mean", world, SEED)):
        loss = loss_and_items(acc.module, shard(batch, rank))[0]
        acc.backward(OOMInBackward.apply(loss) if (rank, i) == (oom_rank, 1) else loss)
    acc.flush()


def adaptive(model: torch.nn.Module, **config) -> AdaptiveGradientAccumulator:
    cfg = GradientAccumulationConfig(accumulation_steps=STEPS, max_grad_norm=0.5, **config)
    return AdaptiveGradientAccumulator(model, make_optimizer(model.parameters()), cfg, micro_batch_size=2)


def expect_named(run: Callable[[], None], rank: int, oom_rank: int, raised: str, bound: float) -> None:
    """run() makes rank `oom_rank` run out of memory and raise `raised` (a regex of its 'Type: message');
    every other rank must raise PeerOutOfMemoryError naming it. All within `bound` s."""
    start = time.monotonic()
    with pytest.raises(Exception) as info:  # the type depends on the rank: checked below
        run()
    assert time.monotonic() - start < bound
    error = info.value
    if rank == oom_rank:
        assert not isinstance(error, PeerOutOfMemoryError)
        info.match(raised.split(": ", 1)[1])
        return
    assert isinstance(error, PeerOutOfMemoryError), repr(error)
    info.match(rf"(?s)rank {oom_rank} ran out of memory.* Rank {oom_rank} raised: {raised}.*Lower the memory per rank")
    assert error.__cause__ is not None  # this rank's own collective failure, chained


def oom_in_step_batch(acc: GradientAccumulator, rank: int, world: int, oom_rank: int) -> Callable[[], None]:
    """Rank `oom_rank` runs out of memory in its 2nd micro-batch's loss_fn."""
    loss_fn = failing_loss(oom_rank, 1, rank, torch.OutOfMemoryError("injected"))
    return lambda: run_until_error(acc, rank, world, loss_fn)


def exit_worker(rank: int, world: int, setup: str) -> None:
    """The OOM rank (1) exits at once; the others fail as soon as its connections close, long before a timeout."""
    if setup == "ddp":  # plain accumulator, one window over all micro-batches: the others fail in flush()
        model = torch.nn.parallel.DistributedDataParallel(make_model())
        cfg = GradientAccumulationConfig(accumulation_steps=MICRO + 1)
        acc = GradientAccumulator(model, make_optimizer(model.parameters()), cfg)
        run, raised = oom_in_step_batch(acc, rank, world, 1), "OutOfMemoryError: injected"
    elif setup == "fsdp-backward":  # plain accumulator, no micro_step(): the others fail in backward()
        model = fsdp_model(init_device_mesh("cpu", (world,)))
        acc = GradientAccumulator(model, make_optimizer(model.parameters()), GradientAccumulationConfig(STEPS))
        run, raised = lambda: backward_outside_micro_step(acc, rank, world, 1), "OutOfMemoryError: injected in backward"
    else:
        shape, names = ((2, world // 2), ("replicate", "shard")) if setup == "hsdp" else ((world,), None)
        acc = adaptive(fsdp_model(init_device_mesh("cpu", shape, mesh_dim_names=names)), sharding=setup)
        run, raised = oom_in_step_batch(acc, rank, world, 1), ADAPTIVE.format(setup)
    expect_named(run, rank, 1, raised, BOUND)
    if rank == 1:
        os._exit(0)  # as a training script ends on an uncaught error


@pytest.mark.parametrize(("setup", "world"), [("fsdp", 2), ("hsdp", 4), ("ddp", 2), ("fsdp-backward", 2)])
def test_oom_rank_exits_peers_name_it_at_once(setup, world):
    launch(exit_worker, world, setup, agent_store=True)


def alive_worker(rank: int, world: int) -> None:
    """The OOM rank stays alive: the others fail at the group timeout; a non-OOM failure keeps its own error."""
    # No OOM yet (none recorded): rank 1's own error stays a ValueError, rank 0's is its collective's timeout.
    group = dist.new_group(timeout=timedelta(seconds=GROUP_TIMEOUT))
    acc = adaptive(fsdp_model(DeviceMesh.from_group(group, "cpu")))
    loss_fn = failing_loss(1, 0, rank, ValueError("rank 1's own bug"))
    with pytest.raises(ValueError if rank == 1 else RuntimeError) as info:
        run_until_error(acc, rank, world, loss_fn)
    assert not isinstance(info.value, PeerOutOfMemoryError), info.value
    dist.barrier()  # on the default group, which nothing desynchronised

    group = dist.new_group(timeout=timedelta(seconds=GROUP_TIMEOUT))
    ddp = torch.nn.parallel.DistributedDataParallel(make_model(), process_group=group)
    # Rank 0 fails in micro-step 2 of 3 (under no_sync); rank 1 waits in the closing backward (DDP's reducer).
    acc = adaptive(ddp, ddp_reduce="overlap")
    expect_named(oom_in_step_batch(acc, rank, world, 0), rank, 0, ADAPTIVE.format("ddp-overlap"), GROUP_TIMEOUT + BOUND)
    dist.barrier()  # rank 0 (hosting the store) stays until rank 1 has read it


def test_oom_rank_alive_peers_name_it_at_group_timeout_and_other_errors_stay():
    launch(alive_worker, 2)
