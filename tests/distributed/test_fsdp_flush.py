"""flush() closes a short last window under FSDP2 fsdp_reduce="window" and under HSDP (both modes), where FSDP
holds the window's partly reduced sums: gathered parameters equal the one-process full-batch loop. HSDP
"micro_step" needs FSDPModule.set_reduce_scatter_unused_params (torch 2.13; not in 2.11, where flush() refuses).

Real gloo processes (tests/distributed/test_fsdp.py's cases and reference); iterate() and micro_step(last=True) close
the same windows in test_fsdp.py.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from _dist import global_batches, launch, needs_gloo
from test_fsdp import SEED, build, check_cases, run
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

pytestmark = [pytest.mark.distributed, needs_gloo]


def fsdp_window_worker(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    check_cases(rank, world, mesh, [("sum", "window", "flush", (4, 1)), ("items", "window", "flush", None)])
    model, _, _, acc = build(mesh, "mean", "window")  # flush() mid-window, then go on: a new window starts clean
    run(acc, model, global_batches("mean", world, SEED), rank, close="none", stop=2)
    assert acc.flush() and acc.optimizer_steps == 1 and acc.micro_steps_in_window == 0
    run(acc, model, global_batches("mean", world, SEED), rank, close="flush", start=2)
    assert acc.optimizer_steps == 3
    dist.barrier()


def hsdp_worker(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    if hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        check_cases(rank, world, mesh, [("sum", "micro_step", "flush", (4, 3))])
    else:  # torch 2.11: FSDP cannot reduce the zeros that carry the held partial sums' all-reduce
        model, _, _, acc = build(mesh, "sum", "micro_step")
        run(acc, model, global_batches("sum", world, SEED), rank, close="none")
        with pytest.raises(RuntimeError, match=r"\(that needs FSDPModule\.set_reduce_scatter_unused_params\)"):
            acc.flush()
        assert acc.optimizer_steps == 2 and acc.micro_steps_in_window > 0  # the refusal changed nothing
    check_cases(rank, world, mesh, [("mean", "window", "flush", None)])


def test_fsdp2_window_mode_flush_closes_the_short_window():
    launch(fsdp_window_worker, 2, timeout=300)


def test_hsdp_flush_closes_the_short_window():
    launch(hsdp_worker, 4, timeout=300)
