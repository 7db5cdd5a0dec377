"""FSDP2 (fully_shard) and HSDP on CPU/gloo, real processes: gathered parameters equal a one-process full-batch loop.

Each launch runs several cases in one process group (the machine is small):
L2 clipping, uneven per-rank token counts (sum mode), "mean" mode weighted
by uneven per-rank, per-micro-batch num_items (kind "items"), a short last
window (flush(), micro_step(last=True) or acc.iterate(loader); flush() under
"window" mode and HSDP in test_fsdp_flush.py), and an
overflow injected on one rank, which must make every rank skip that window.
The window ends in the fused tail (fused_step="auto") unless a case says
otherwise; float32 cases compare it with the plain tail, float64 ones take its
unscale and clip passes.
"""

from __future__ import annotations

from math import inf

import pytest
import torch
import torch.distributed as dist
from _cases import OpCounter
from _dist import (
    IN,
    LR,
    MICRO,
    OUT,
    STEPS,
    assert_params_equal,
    dcp_load,
    dcp_save,
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from gradacc_ext import GradientAccumulationConfig, GradientAccumulator
from gradacc_ext.optim import FusedAdamW

pytestmark = [pytest.mark.distributed, needs_gloo]
SEED = 5
TOL32 = dict(rtol=1e-4, atol=1e-5)  # float32: the one-process loop sums in another order


def bottleneck_model(dtype: torch.dtype = torch.float64, seed: int = 11) -> torch.nn.Module:
    """A 1-wide layer: on 2 ranks its weight and bias shard as 1 + 0 rows (rank 1's shards are empty)."""
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(IN, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1), torch.nn.Tanh(), torch.nn.Linear(1, OUT)]
    return torch.nn.Sequential(*layers).to(dtype)


def build(mesh, kind: str, reduce: str, norm_type: float = 2.0, fused_step="auto", fused_adamw=False, **model_kw):
    model = fsdp_model(mesh, **model_kw)
    if fused_adamw:
        opt = FusedAdamW(model.parameters(), lr=LR, weight_decay=0.1)
    else:
        opt = make_optimizer(model.parameters(), sgd="mp_policy" in model_kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    config = GradientAccumulationConfig(
        accumulation_steps=STEPS,
        max_grad_norm=0.5,
        norm_type=norm_type,
        loss_normalization="sum" if kind == "sum" else "mean",
        fsdp_reduce=reduce,
        fused_step=fused_step,
    )
    return model, opt, sched, GradientAccumulator(model, opt, config, sched)


def assert_tail(acc, fused: bool, windows: int = 3) -> None:
    """The stats name the tail that ran; the fused one made one op call per window, skipped ones included."""
    stats = acc.get_accumulation_stats()
    assert stats["fused_step"] is fused, stats["fused_step_reason"]
    assert (acc._end.tail.calls if fused else windows) == windows


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
        assert_tail(acc, True)


def check_fused_tail(rank: int, world: int, mesh, cases, make=make_model) -> None:
    """float32, where normaliser and clip coefficient ride in the op's grad multiplier: the fused tail equals
    the plain tail and the one-process loop, and the optimizer state stays torch's, as DTensors. The fused
    tail's norm comes from the last fold (counted: no norm pass but a flush()ed window's)."""
    for kind, reduce, close, inject, *norm in cases:
        skip, norm_type = (None if inject is None else inject[0] // STEPS), (norm[0] if norm else 2.0)
        ref = reference(kind, world, SEED, skip, dtype=torch.float32, make=make, norm_type=norm_type)
        runs = []
        for fused in (True, False):
            model, opt, _, acc = build(mesh, kind, reduce, norm_type, fused, dtype=torch.float32, make=make)
            with pytest.MonkeyPatch.context() as patch:
                count = OpCounter(patch)
                run(acc, model, global_batches(kind, world, SEED, torch.float32), rank, close=close, inject=inject)
            assert_tail(acc, fused)
            if fused:  # every mode reduces before the last fold: that fold gathers the norm on the shards
                assert count.final_calls > 0, (kind, reduce, close)
                # a flush()ed short window folds outside a last micro-step: only it takes the norm pass
                assert (count.norm_bytes == 0) == (close != "flush"), (kind, reduce, close, count.norm_bytes)
            assert (acc.optimizer_steps, acc.skipped_steps) == ((2, 1) if inject else (3, 0)), (kind, reduce)
            assert_params_equal(model, ref, **TOL32)
            runs.append((model, opt))
        (model, opt), (plain, plain_opt) = runs
        assert_params_equal(model, plain, **TOL32)
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            mine, theirs = opt.state[p], plain_opt.state[q]
            assert torch.equal(mine["step"], theirs["step"])
            for key in ("exp_avg", "exp_avg_sq"):
                assert isinstance(mine[key], DTensor) and mine[key].placements == theirs[key].placements
                torch.testing.assert_close(mine[key].full_tensor(), theirs[key].full_tensor(), **TOL32)


def fsdp_worker(rank: int, world: int, ckpt: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    cases = [("sum", "micro_step", "flush", None), ("sum", "window", "last", (4, 1))]
    cases += [("mean", "micro_step", "last", (1, 0)), ("sum", "micro_step", "last", None, inf)]
    cases += [("items", "micro_step", "flush", (4, 0)), ("items", "window", "iterate", None)]  # mean + num_items
    check_cases(rank, world, mesh, cases)
    check_fused_tail(rank, world, mesh, [("sum", "micro_step", "flush", (4, 1)), ("mean", "window", "last", (1, 0))])
    check_fused_tail(rank, world, mesh, [("sum", "micro_step", "last", None, inf)])
    empty = [p.to_local().numel() == 0 for p in fsdp_model(mesh, make=bottleneck_model).parameters()]
    assert any(empty) is (rank == 1)
    check_fused_tail(rank, world, mesh, [("sum", "micro_step", "flush", None)], make=bottleneck_model)
    # bf16 compute, fp32 reduce and fp32 sharded parameters: within bf16 rounding of the float32 reference.
    model, opt, _, acc = build(
        mesh, "sum", "micro_step", dtype=torch.float32, mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    )
    run(acc, model, global_batches("sum", world, SEED, torch.float32), rank, close="flush")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert_params_equal(model, reference("sum", world, SEED, dtype=torch.float32, sgd=True), rtol=2e-2, atol=2e-2)
    assert_tail(acc, True)  # SGD with momentum, buffers as DTensors
    check_resume(rank, world, lambda: build(mesh, "sum", "micro_step"), ckpt + "-adamw")
    check_resume(rank, world, lambda: build(mesh, "sum", "micro_step", fused_adamw=True), ckpt + "-fused")
    check_sharded_memory(rank, world, mesh)
    # FusedAdamW's own clip sees only this rank's shards: refused (the accumulator's max_grad_norm is global),
    # by the accumulator at construction and by the optimizer's step without one.
    model = fsdp_model(mesh)
    opt = FusedAdamW(model.parameters(), max_grad_norm=1.0)
    with pytest.raises(ValueError, match=r"FusedAdamW\(max_grad_norm=1.0\) would clip by this rank's FSDP2 shards"):
        GradientAccumulator(model, opt, GradientAccumulationConfig(accumulation_steps=STEPS))  # at once, every rank
    loss_and_items(model, shard(global_batches("mean", world, SEED)[0], rank))[0].backward()
    with pytest.raises(ValueError, match=r"FusedAdamW\(max_grad_norm=...\) cannot clip sharded"):
        opt.step()


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
    dcp_save(model, opt, acc, ckpt)
    sched_state = sched.state_dict()  # the same on every rank: saved as usual
    run(acc, model, batches, rank, close="flush", start=cut)

    model2, opt2, sched2, acc2 = make()
    dcp_load(model2, opt2, acc2, ckpt)
    sched2.load_state_dict(sched_state)
    assert acc2.micro_steps_in_window == 2
    run(acc2, model2, batches, rank, close="flush", start=cut)
    assert_tail(acc2, True, windows=2)
    assert_params_equal(model2, model, rtol=0, atol=0)
    assert_params_equal(model2, reference("sum", world, seed))


def test_fsdp2_two_ranks_modes_mixed_precision_and_resume(tmp_path):
    launch(fsdp_worker, 2, str(tmp_path / "ckpt"))


def hsdp_worker(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    cases = [("sum", "micro_step", "last", (4, 3)), ("mean", "window", "last", None)]
    cases += [("items", "micro_step", "iterate", None), ("items", "window", "last", None)]  # mean + num_items
    check_cases(rank, world, mesh, cases)
    check_fused_tail(rank, world, mesh, [("sum", "micro_step", "last", (4, 3))])  # flush(): test_fsdp_flush.py


def test_hsdp_four_ranks_replicate_x_shard():
    launch(hsdp_worker, 4)
