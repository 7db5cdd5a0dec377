"""Bad distributed setups fail on every rank with a clear error before any collective (so none hangs).

After each expected error the ranks run a barrier: had one rank entered a
collective, the group would be out of step and this would hang or fail.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _dist import (
    STEPS,
    assert_params_equal,
    fsdp_model,
    global_batches,
    launch,
    loss_and_items,
    make_model,
    make_optimizer,
    needs_gloo,
    reference,
    shard,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

from gradacc_ext import AdaptiveGradientAccumulator, GradientAccumulationConfig, GradientAccumulator

SEED = 13


def config(**kw) -> GradientAccumulationConfig:
    return GradientAccumulationConfig(**{"accumulation_steps": 2, **kw})


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def test_no_process_group_and_plain_model_options():
    model = make_model()
    with pytest.raises(RuntimeError, match="no process group is initialised"):
        GradientAccumulator(model, sgd(model), config(world_size=2))
    with pytest.raises(ValueError, match="ddp_reduce='overlap' needs a DistributedDataParallel model"):
        GradientAccumulator(model, sgd(model), config(ddp_reduce="overlap"))
    with pytest.raises(ValueError, match="comm_dtype applies to DistributedDataParallel models; this one is 'local'"):
        GradientAccumulator(model, sgd(model), config(comm_dtype=torch.bfloat16))
    for field, value in (("fsdp_reduce", "once"), ("ddp_reduce", "bucket"), ("sharding", "2d"), ("comm_dtype", 16)):
        with pytest.raises(ValueError, match=f"GradientAccumulationConfig.{field} must be one of"):
            config(**{field: value})


def expect(error: type[Exception], match: str, make) -> None:
    with pytest.raises(error, match=match):
        make()
    dist.barrier()


def worker(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    half = make_model()
    fully_shard(half[0], mesh=mesh)  # the last Linear stays plain
    expect(
        TypeError,
        r"some trainable parameters are DTensors .*2\.weight",
        lambda: GradientAccumulator(half, sgd(half), config()),
    )
    model = fsdp_model(mesh)
    expect(
        TypeError,
        "pass the fully_shard-ed model",
        lambda: GradientAccumulator(model.parameters(), sgd(model), config()),
    )
    expect(
        ValueError,
        r"sharding='hsdp' needs a 2-D mesh",
        lambda: GradientAccumulator(model, sgd(model), config(sharding="hsdp")),
    )
    planned = config(accumulation_steps=None, target_batch_size=10, micro_batch_size=2)  # planned for one rank
    expect(
        ValueError,
        r"world_size=1, but the fsdp model runs data-parallel over 2 ranks.*not a multiple",
        lambda: GradientAccumulator(model, sgd(model), planned),
    )
    fsdp1 = FullyShardedDataParallel(make_model(), device_id=torch.device("cpu"))  # its params: plain flat shards
    expect(
        TypeError,
        r"the model is wrapped in FSDP1 .*fully_shard",
        lambda: GradientAccumulator(fsdp1, sgd(fsdp1), config()),
    )
    assert all(p.grad is None and not p._post_accumulate_grad_hooks for p in fsdp1.parameters())  # nothing attached
    ddp = torch.nn.parallel.DistributedDataParallel(make_model().to(torch.bfloat16))
    expect(
        ValueError,
        r"must have the parameters' dtype, but module\.0\.weight is torch\.bfloat16",
        lambda: GradientAccumulator(ddp, sgd(ddp), config(ddp_reduce="overlap")),
    )

    x = torch.randn(2, 5, dtype=torch.float64)
    acc = GradientAccumulator(model, sgd(model), config(accumulation_steps=3, fsdp_reduce="window"))
    with acc.micro_step():
        acc.backward(model(x).sum())
    expect(RuntimeError, r"take a mid-window checkpoint.*micro_step\(last=True\)", acc.state_dict)
    assert (acc.micro_steps_in_window, acc.optimizer_steps) == (1, 0)  # the error changed nothing
    assert acc.flush() and acc.optimizer_steps == 1  # flush() releases FSDP's held sums (test_fsdp_flush.py)
    with acc.micro_step(last=True):
        assert acc.backward(model(x).sum())
    assert acc.optimizer_steps == 2


@pytest.mark.distributed
@needs_gloo
def test_bad_setups_fail_before_any_collective():
    launch(worker, 2)


def adaptive_worker(rank: int, world: int) -> None:
    """Rank 0 runs out of memory once: under DDP it splits alone and stays exact; under FSDP2 every rank fails
    (rank 1 at the group's timeout, naming rank 0: tests/distributed/test_dist_oom.py has the cases)."""
    batches = global_batches("mean", world, SEED)
    oom_once = [rank == 0]

    def loss_fn(model, batch):
        if oom_once[0]:
            oom_once[0] = False
            raise torch.OutOfMemoryError("injected")
        return loss_and_items(model, batch)[0]

    ddp = torch.nn.parallel.DistributedDataParallel(make_model())
    opt = make_optimizer(ddp.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    acc = AdaptiveGradientAccumulator(
        ddp, opt, config(accumulation_steps=STEPS, max_grad_norm=0.5), sched, micro_batch_size=2
    )
    for batch in batches:
        acc.step_batch(shard(batch, rank), loss_fn)
    acc.flush()
    assert acc.micro_batch_size == (1 if rank == 0 else 2)
    assert_params_equal(ddp.module, reference("mean", world, SEED))

    group = dist.new_group(timeout=timedelta(seconds=3))  # FSDP's collectives time out fast here
    model = fsdp_model(DeviceMesh.from_group(group, "cpu"))
    acc = AdaptiveGradientAccumulator(model, make_optimizer(model.parameters()), config())
    oom_once[0] = rank == 0
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="cannot split alone" if rank == 0 else "rank 0 ran out of memory"):
        acc.step_batch(shard(batches[0], rank), loss_fn)
    assert time.monotonic() - start < 30
    dist.barrier()


@pytest.mark.distributed
@needs_gloo
def test_adaptive_oom_on_one_rank():
    launch(adaptive_worker, 2)
