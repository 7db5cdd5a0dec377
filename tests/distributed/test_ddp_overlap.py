"""DDP with ddp_reduce="overlap" (DDP's own bucketed reducer over the accumulator's buffers), 2 gloo ranks.

The gathered parameters equal a one-process full-batch loop with L2
clipping, uneven per-rank token counts ("sum" mode, and "mean" mode weighted
by num_items), a short last window (closed by flush(): the whole-buffer
fallback, or by micro_step(last=True) or acc.iterate(): the reducer) and an
overflow on one rank; bf16 communication stays within bf16 rounding of it.
"""

from __future__ import annotations

import pytest
import torch
from _dist import (
    STEPS,
    assert_params_equal,
    full_params,
    global_batches,
    launch,
    make_model,
    make_optimizer,
    needs_gloo,
    reference,
)
from test_fsdp import check_resume, run

from gradacc_ext import GradientAccumulationConfig, GradientAccumulator
from gradacc_ext.distributed.ddp import DDPOverlapSync

pytestmark = [pytest.mark.distributed, needs_gloo]
SEED = 9


def build(kind: str, dtype=torch.float64, comm_dtype=None, reduce: str = "overlap", grad_views: bool = False):
    model = torch.nn.parallel.DistributedDataParallel(make_model(dtype), bucket_cap_mb=1e-4)  # several buckets
    opt = make_optimizer(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    config = GradientAccumulationConfig(
        accumulation_steps=STEPS,
        max_grad_norm=0.5,
        loss_normalization="sum" if kind == "sum" else "mean",
        ddp_reduce=reduce,
        comm_dtype=comm_dtype,
        grad_views=grad_views,
    )
    return model, opt, sched, GradientAccumulator(model, opt, config, sched)


def worker(rank: int, world: int, ckpt: str) -> None:
    cases = (("sum", "flush", None), ("sum", "last", (4, 0)), ("mean", "last", None))
    for kind, close, inject in (*cases, ("items", "iterate", (1, 1)), ("items", "flush", None)):
        model, _, sched, acc = build(kind, grad_views=kind != "sum")  # views between micro-steps too
        assert isinstance(acc._sync, DDPOverlapSync)
        run(acc, model, global_batches(kind, world, SEED), rank, close=close, inject=inject)
        assert_params_equal(model.module, reference(kind, world, SEED, None if inject is None else inject[0] // STEPS))
        assert (acc.optimizer_steps, acc.skipped_steps) == ((2, 1) if inject else (3, 0))
        assert sched.last_epoch == acc.optimizer_steps
    ref = reference("sum", world, SEED, dtype=torch.float32)
    for reduce in ("overlap", "buffer"):  # bf16 on the wire, fp32 buffers: within bf16 rounding, not exact
        model, _, _, acc = build("sum", torch.float32, torch.bfloat16, reduce)
        run(acc, model, global_batches("sum", world, SEED, torch.float32), rank, close="last")
        assert_params_equal(model.module, ref, rtol=1e-2, atol=1e-2)
        gap = max((p - q).abs().max().item() for p, q in zip(full_params(model.module), full_params(ref), strict=True))
        assert gap > 1e-6, f"{reduce}: no bf16 rounding seen; fp32 communication differs by ~1e-7"
    # Mid-window DCP checkpoint: each rank's unreduced buffers and counts are its own rows.
    check_resume(rank, world, lambda: build("sum", reduce="buffer"), ckpt, SEED)


def test_ddp_overlap_two_ranks_equals_full_batch_and_resumes(tmp_path):
    launch(worker, 2, str(tmp_path / "ckpt"))
