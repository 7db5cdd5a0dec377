"""Migrating a hand-written FSDP2 or DDP accumulation loop to gradacc (2 gloo ranks, float64).

The hand-written loop: AdamW + StepLR, set_requires_gradient_sync(False) / no_sync() until each
window's last micro-batch, per-row mean losses weighted by the window's global row count (uneven
per rank and per micro-batch), clip_grad_norm_, and a short last window. The migrated loop is the
migration guide's (docs/migration.md, "A hand-written DDP or FSDP2 loop"): `for batch in acc.iterate(loader)`,
each micro-batch's mean loss with num_items.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import (
    LR,
    MICRO,
    STEPS,
    assert_params_equal,
    fsdp_model,
    global_batches,
    launch,
    make_model,
    needs_gloo,
    shard,
)
from torch.distributed.device_mesh import init_device_mesh

from gradacc_ext import GradientAccumulationConfig, GradientAccumulator

pytestmark = [pytest.mark.distributed, needs_gloo]
SEED, CLIP = 17, 0.5


def wrapped(wrap: str, mesh) -> torch.nn.Module:
    return torch.nn.parallel.DistributedDataParallel(make_model()) if wrap == "ddp" else fsdp_model(mesh)


def optimizer_and_scheduler(model):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)


def hand_written(wrap: str, mesh, loader: list, world: int) -> torch.nn.Module:
    model = wrapped(wrap, mesh)
    opt, sched = optimizer_and_scheduler(model)
    for start in range(0, len(loader), STEPS):
        window = loader[start : start + STEPS]
        rows = torch.tensor(float(sum(len(b.x) for b in window)), dtype=torch.float64)
        dist.all_reduce(rows)  # the window's global row count
        for i, batch in enumerate(window):
            last = i == len(window) - 1
            if wrap == "fsdp":
                model.set_requires_gradient_sync(last)
            with model.no_sync() if wrap == "ddp" and not last else contextlib.nullcontext():
                # mse_loss's mean divides by rows x outputs; DDP and FSDP average over ranks: x world undoes it
                loss = F.mse_loss(model(batch.x), batch.y, reduction="sum") / batch.y.shape[1] / rows * world
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
    return model


def migrated(wrap: str, mesh, loader: list, **options) -> torch.nn.Module:
    model = wrapped(wrap, mesh)
    opt, sched = optimizer_and_scheduler(model)
    config = GradientAccumulationConfig(accumulation_steps=STEPS, max_grad_norm=CLIP, **options)
    acc = GradientAccumulator(model, opt, config, sched)
    for batch in acc.iterate(loader):
        with acc.micro_step():
            loss = F.mse_loss(model(batch.x), batch.y)  # this rank's micro-batch mean
            acc.backward(loss, num_items=len(batch.x))
    assert (acc.optimizer_steps, sched.last_epoch) == (3, 3)
    return model


def worker(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    loader = [shard(b, rank) for b in global_batches("items", world, SEED)]
    assert len(loader) == MICRO and len({len(b.x) for b in loader}) > 1  # uneven rows, a short last window
    for wrap, options in (
        ("fsdp", {}),
        ("fsdp", {"fsdp_reduce": "window"}),
        ("ddp", {}),
        ("ddp", {"ddp_reduce": "overlap"}),
    ):
        assert_params_equal(migrated(wrap, mesh, loader, **options), hand_written(wrap, mesh, loader, world))


def test_hand_written_fsdp2_and_ddp_loops_migrate_with_iterate():
    launch(worker, 2)
