"""A mid-window DCP checkpoint after one rank read a counter resumes exactly (DDP and FSDP2, gloo).

The fused tail's skip decision used to be read lazily, at the first counter read: a log line on
rank 0 resolved it there, counting the step and stepping rank 0's scheduler (its lr), while the
other ranks still held it pending. The checkpoint then held per-rank learning rates, counters and
pending outcomes under keys that DCP keeps once: the resumed run stepped with another rank's lr
(params off by ~1e-4 here) or lost a counted step. Under data parallelism the step now resolves at
once, so every rank's state agrees at every point.
"""

from __future__ import annotations

import pytest
import torch
from _dist import (
    MICRO,
    STEPS,
    assert_params_equal,
    dcp_load,
    dcp_save,
    fsdp_model,
    global_batches,
    launch,
    make_model,
    needs_gloo,
)
from test_fsdp import SEED, run
from torch.distributed.device_mesh import init_device_mesh

from gradacc_ext import GradientAccumulationConfig, GradientAccumulator

pytestmark = [pytest.mark.distributed, needs_gloo]


def build(mesh, wrap: str):
    if wrap == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(make_model())
    else:
        model = fsdp_model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.03, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    config = GradientAccumulationConfig(accumulation_steps=STEPS, max_grad_norm=0.5, loss_normalization="sum")
    return model, opt, sched, GradientAccumulator(model, opt, config, sched)


def check(rank: int, world: int, mesh, wrap: str, reader: int, ckpt: str) -> None:
    """Save 2 micro-steps into window 2 after rank `reader` read a counter; resume; equal to uninterrupted."""
    batches, cut = global_batches("sum", world, SEED), STEPS + 2
    model, opt, sched, acc = build(mesh, wrap)
    run(acc, model, batches, rank, close="flush", stop=cut)
    if rank == reader:
        assert acc.optimizer_steps == 1  # a log line on one rank
    dcp_save(model, opt, acc, ckpt)
    sched_state = sched.state_dict()  # this rank's, saved with it
    run(acc, model, batches, rank, close="flush", start=cut)

    model2, opt2, sched2, acc2 = build(mesh, wrap)
    dcp_load(model2, opt2, acc2, ckpt)
    sched2.load_state_dict(sched_state)
    run(acc2, model2, batches, rank, close="flush", start=cut)
    expected = (MICRO + STEPS - 1) // STEPS
    assert (acc.optimizer_steps, sched.last_epoch) == (expected, expected)
    assert (acc2.optimizer_steps, acc2.skipped_steps, sched2.last_epoch) == (expected, 0, expected), (wrap, reader)
    assert_params_equal(model2, model, rtol=0, atol=0)


def worker(rank: int, world: int, ckpt: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    for wrap in ("ddp", "fsdp"):
        for reader in range(world):
            check(rank, world, mesh, wrap, reader, f"{ckpt}-{wrap}-{reader}")


def test_counters_and_deferred_outcome_resume_per_rank(tmp_path):
    launch(worker, 2, str(tmp_path / "ckpt"))
