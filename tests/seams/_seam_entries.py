"""The four entries of the seam matrix, each driving one cell on one rank the way a user would write it:
the core API, the guides' API (gradacc_ext.compat), an Accelerate-prepared loop, and the Lightning callback.

A user's loop catches the injected OOM and retries the micro-batch (the adaptive path splits it itself).
A "checkpoint" cell runs in two processes: phase "save" trains CHECKPOINT_AT micro-batches and saves
mid-window; phase "resume" builds everything afresh, loads and trains the rest.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from _seam_cells import (
    CHECKPOINT_AT,
    CHUNK,
    config_fields,
    make_model,
    make_optimizer,
    make_scheduler,
    mse,
    samples,
    shard,
    user_scaler,
)
from _seam_table import FSDP_MODES, Cell


def wrap(cell: Cell, model: torch.nn.Module, world: int) -> torch.nn.Module:
    """The cell's data parallelism around the model (the harness's own wrapping; Accelerate and Lightning
    wrap DDP themselves)."""
    if cell.parallel.startswith("ddp_") and cell.entry in ("core", "compat"):
        return torch.nn.parallel.DistributedDataParallel(model)
    if cell.parallel in FSDP_MODES:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        shape, names = ((2, world // 2), ("replicate", "shard")) if cell.parallel == "hsdp" else ((world,), None)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for module in (*(m for m in model if isinstance(m, torch.nn.Linear)), model):
            fully_shard(module, mesh=mesh)
    return model


def retry_on_oom(step: Callable[[], object]) -> None:
    """The user's retry: the injected OOM fires once, so the second try must go through."""
    try:
        step()
    except torch.OutOfMemoryError:
        step()


def _accumulator(cell: Cell, model, opt, sched, scaler):
    import gradacc_ext
    import gradacc_ext.compat as compat

    kw = {"micro_batch_size": CHUNK} if cell.path == "adaptive" else {}
    if cell.entry == "compat":
        cls = compat.AdaptiveGradientAccumulator if cell.path == "adaptive" else compat.GradientAccumulator
        acc = cls(compat.GradientAccumulationConfig(**config_fields(cell)), **kw)
        acc.attach(model, opt, sched, scaler)
        return acc
    cls = gradacc_ext.AdaptiveGradientAccumulator if cell.path == "adaptive" else gradacc_ext.GradientAccumulator
    return cls(model, opt, gradacc_ext.GradientAccumulationConfig(**config_fields(cell)), sched, scaler, **kw)


def _prepare(cell: Cell, model, opt):
    """Accelerate: the Accelerator wraps the model (DDP on several processes) and the optimizer."""
    import accelerate

    accelerate.state.AcceleratorState._reset_state(True)  # process-wide settings (accelerate's tests reset them)
    accelerator = accelerate.Accelerator(cpu=True)
    return accelerator.prepare(model, opt)


def build(cell: Cell, rank: int, world: int):
    """What the user builds: (model, optimizer, scheduler, scaler, accumulator)."""
    model = wrap(cell, make_model(cell, rank), world)
    opt = make_optimizer(cell, model.parameters())
    if cell.entry == "accelerate":
        model, opt = _prepare(cell, model, opt)
    sched, scaler = make_scheduler(opt), user_scaler(cell)
    return model, opt, sched, scaler, _accumulator(cell, model, opt, sched, scaler)


def _micro_batch(cell: Cell, acc, model, opt, scaler, batch) -> None:
    if cell.path == "adaptive":
        acc.step_batch(batch, mse)  # splits on OOM itself
        return

    def step() -> None:
        with acc.micro_step():
            loss = mse(model, batch)
            if cell.entry == "compat":
                acc.accumulate_gradients(loss, model, opt, scaler)
            else:
                acc.backward(loss)

    retry_on_oom(step)


def _checkpoint_file(ckpt: str, rank: int) -> str:
    return os.path.join(ckpt, f"rank{rank}.pt")


def save(cell: Cell, parts, ckpt: str, rank: int) -> None:
    model, opt, sched, scaler, acc = parts
    local = {"sched": sched.state_dict(), "scaler": scaler.state_dict() if scaler else None}
    if cell.parallel in FSDP_MODES:
        from _dist import dcp_save

        dcp_save(model, opt, acc, os.path.join(ckpt, "dcp"))
    else:
        local.update(model=model.state_dict(), opt=opt.state_dict(), acc=acc.state_dict())
    torch.save(local, _checkpoint_file(ckpt, rank))


def load(cell: Cell, parts, ckpt: str, rank: int) -> None:
    model, opt, sched, scaler, acc = parts
    local = torch.load(_checkpoint_file(ckpt, rank), weights_only=False)
    if cell.parallel in FSDP_MODES:
        from _dist import dcp_load

        dcp_load(model, opt, acc, os.path.join(ckpt, "dcp"))
    else:
        model.load_state_dict(local["model"])
        opt.load_state_dict(local["opt"])
        acc.load_state_dict(local["acc"])
    sched.load_state_dict(local["sched"])
    if scaler:
        scaler.load_state_dict(local["scaler"])


def run_loop(cell: Cell, rank: int, world: int, phase: str, ckpt: str, parts, before_save: Callable[[], None]) -> bool:
    """core / compat / accelerate: True when the run finished (False: phase "save" stopped to save; before_save()
    runs just before the checkpoint is taken)."""
    model, opt, sched, scaler, acc = parts
    batches = samples(cell, world)
    start, stop = 0, len(batches)
    if phase == "save":
        stop = CHECKPOINT_AT
    elif phase == "resume":
        load(cell, parts, ckpt, rank)
        start = CHECKPOINT_AT
    for batch in batches[start:stop]:
        _micro_batch(cell, acc, model, opt, scaler, shard(batch, rank))
    if phase == "save":
        before_save()
        save(cell, parts, ckpt, rank)
        return False
    if cell.entry == "compat":
        with acc.accumulation_context(model):  # the guides' context: applies the short last window on exit
            pass
    else:
        acc.flush()
    return True
