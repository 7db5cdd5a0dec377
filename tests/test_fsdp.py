"""FSDP2 (fully_shard) and HSDP on CPU/gloo, real processes: gathered parameters equal a one-process full-batch loop.

Each launch runs several cases in one process group (the machine is small):
L2 clipping, uneven per-rank token counts (sum mode), "mean" mode weighted
by uneven per-rank, per-micro-batch num_items (kind "items"), a short last
window (flush(), micro_step(last=True) or acc.iterate(loader)), and an
overflow injected on one rank, which must make every rank skip that window.
"""

from __future__ import annotations

from math import inf

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import (
    MICRO,
    STEPS,
    assert_params_equal,
    global_batches,
    launch,
    loss_and_items,
    make_model,
    make_optimizer,
    needs_gloo,
    reference,
    shard,
)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from gradacc_ext import GradientAccumulationConfig, GradientAccumulator

pytestmark = [pytest.mark.distributed, needs_gloo]
SEED = 5


def fsdp_model(mesh, dtype=torch.float64, mp_policy: MixedPrecisionPolicy | None = None) -> torch.nn.Module:
    model = make_model(dtype)
    kwargs = {"mesh": mesh, **({"mp_policy": mp_policy} if mp_policy else {})}
    for module in (model[0], model[2], model):
        fully_shard(module, **kwargs)
    return model


def build(mesh, kind: str, reduce: str, norm_type: float = 2.0, **model_kw):
    model = fsdp_model(mesh, **model_kw)
    opt = make_optimizer(model.parameters(), sgd="mp_policy" in model_kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    config = GradientAccumulationConfig(
        accumulation_steps=STEPS,
        max_grad_norm=0.5,
        norm_type=norm_type,
        fsdp_reduce=reduce,
        loss_normalization="sum" if kind == "sum" else "mean",
    )
    return model, opt, sched, GradientAccumulator(model, opt, config, sched)


def run(acc, model, batches, rank, *, close: str, inject=None, start: int = 0, stop: int = MICRO) -> None:
    """Micro-batches start..stop; inject=(i, r): rank r's loss of micro-batch i becomes non-finite.

    close: how the short last window closes: "flush", "last" (micro_step(last=True)), "iterate"
    (acc.iterate over the micro-batches, then a flush() that must find nothing left), "none".
    """
    for i in acc.iterate(range(start, stop)) if close == "iterate" else range(start, stop):
        with acc.micro_step(last=close == "last" and i == MICRO - 1):
            loss, items = loss_and_items(model, shard(batches[i], rank))
            if inject == (i, rank):
                loss = loss * float("inf")
            acc.backward(loss, num_items=items)
    if close in ("flush", "iterate") and stop == MICRO:
        assert acc.flush() == (close == "flush")


def check_cases(rank: int, world: int, mesh, cases) -> None:
    """cases: (loss normalisation, fsdp_reduce, how the short window closes, injected overflow[, norm_type])."""
    for kind, reduce, close, inject, *norm in cases:
        model, _, sched, acc = build(mesh, kind, reduce, *norm)
        run(acc, model, global_batches(kind, world, SEED), rank, close=close, inject=inject)
        skip = None if inject is None else inject[0] // STEPS
        assert_params_equal(model, reference(kind, world, SEED, skip, norm_type=norm[0] if norm else 2.0))
        assert (acc.optimizer_steps, acc.skipped_steps) == ((2, 1) if inject else (3, 0)), (kind, reduce, close)
        assert sched.last_epoch == acc.optimizer_steps


def fsdp_worker(rank: int, world: int, ckpt: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    cases = [("sum", "micro_step", "flush", None), ("sum", "window", "last", (4, 1))]
    cases += [("mean", "micro_step", "last", (1, 0)), ("sum", "micro_step", "last", None, inf)]
    cases += [("items", "micro_step", "flush", (4, 0)), ("items", "window", "iterate", None)]  # mean + num_items
    check_cases(rank, world, mesh, cases)
    # bf16 compute, fp32 reduce and fp32 sharded parameters: within bf16 rounding of the float32 reference.
    model, opt, _, acc = build(
        mesh, "sum", "micro_step", dtype=torch.float32, mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    )
    run(acc, model, global_batches("sum", world, SEED, torch.float32), rank, close="flush")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert_params_equal(model, reference("sum", world, SEED, dtype=torch.float32, sgd=True), rtol=2e-2, atol=2e-2)
    check_resume(rank, world, lambda: build(mesh, "sum", "micro_step"), ckpt)
    check_sharded_memory(rank, world, mesh)


def check_sharded_memory(rank: int, world: int, mesh) -> None:
    """Between micro-steps no gradient lives outside the buffers, which hold only this rank's shards."""
    model, _, _, acc = build(mesh, "sum", "micro_step")
    run(acc, model, global_batches("sum", world, SEED), rank, close="none", stop=2)
    assert all(p.grad is None for p in model.parameters())
    local = sum(p.to_local().numel() for p in model.parameters())
    full = sum(p.numel() for p in model.parameters())
    held = sum(f.numel() for f in acc._buffers.flats.values())
    assert local <= held < local + 4 * len(acc.params)  # 16-byte alignment padding only
    shares = [0] * world
    dist.all_gather_object(shares, local)
    assert sum(shares) == full  # the ranks' buffers together hold one copy of the gradient


def check_resume(rank: int, world: int, make, ckpt: str, seed: int = SEED) -> None:
    """Save mid-window (2 micro-steps into window 2) with DCP, resume in fresh objects: same as uninterrupted.

    make() -> (model, optimizer, scheduler, accumulator), built the same way each call.
    """
    batches, cut = global_batches("sum", world, seed), STEPS + 2
    model, opt, sched, acc = make()
    run(acc, model, batches, rank, close="flush", stop=cut)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "acc": acc.state_dict()}, checkpoint_id=ckpt)
    sched_state = sched.state_dict()  # the same on every rank: saved as usual
    run(acc, model, batches, rank, close="flush", start=cut)

    model2, opt2, sched2, acc2 = make()
    msd, osd = get_state_dict(model2, opt2)
    state = {"model": msd, "optim": osd, "acc": acc2.state_dict()}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    acc2.load_state_dict(state["acc"])
    sched2.load_state_dict(sched_state)
    assert acc2.micro_steps_in_window == 2
    run(acc2, model2, batches, rank, close="flush", start=cut)
    assert_params_equal(model2, model, rtol=0, atol=0)
    assert_params_equal(model2, reference("sum", world, seed))


def test_fsdp2_two_ranks_modes_mixed_precision_and_resume(tmp_path):
    launch(fsdp_worker, 2, str(tmp_path / "ckpt"))


def hsdp_worker(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    cases = [("sum", "micro_step", "last", (4, 3)), ("mean", "window", "last", None)]
    cases += [("items", "micro_step", "iterate", None), ("items", "window", "last", None)]  # mean + num_items
    check_cases(rank, world, mesh, cases)
    model, _, _, acc = build(mesh, "mean", "micro_step")
    batches = global_batches("mean", world, SEED)
    run(acc, model, batches, rank, close="none", stop=2)
    with pytest.raises(RuntimeError, match=r"for batch in acc\.iterate\(loader\):.*micro_step\(last=True\)"):
        acc.flush()
    dist.barrier()  # every rank raised before any collective: the group is still in step


def test_hsdp_four_ranks_replicate_x_shard():
    launch(hsdp_worker, 4)
