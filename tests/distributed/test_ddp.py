"""Two-process DDP (gloo, CPU, loopback) equals single-process full-batch training (FSDP2: test_fsdp.py).

Every rank runs the accumulator on its shard of each micro-batch under DDP
and compares the final parameters with a plain full-batch loop it runs
itself on the whole data. A hang fails: the process group has a 30 s
timeout and the parent kills the workers after 90 s.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from _cases import IN, OUT, make_model, padded_batches, token_sum

from gradacc_ext.accumulate.accumulator import GradientAccumulator
from gradacc_ext.accumulate.config import GradientAccumulationConfig

WORLD, N, MICRO, SEED = 2, 3, 7, 123
DTYPE = torch.float64


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def global_batches(mode: str):
    """MICRO global micro-batches of WORLD * 3 rows (mean mode) or padded token batches (sum mode)."""
    if mode == "sum":
        return padded_batches(MICRO, SEED, DTYPE, max_len=6)
    g = torch.Generator().manual_seed(SEED)
    return [
        (torch.randn(WORLD * 3, IN, generator=g, dtype=DTYPE), torch.randn(WORLD * 3, OUT, generator=g, dtype=DTYPE))
        for _ in range(MICRO)
    ]


def shard(batch, rank: int):
    """Rank r's rows of a global micro-batch (sum mode: uneven shares, so token counts differ across ranks)."""
    rows = batch[0].shape[0]
    cut = max(1, rows // 3) if len(batch) == 3 else rows // 2  # mean mode: equal micro-batches per rank
    lo, hi = (0, cut) if rank == 0 else (cut, rows)
    return tuple(t[lo:hi] for t in batch)


def loss_and_items(model, batch, mode: str):
    if mode == "sum":
        return token_sum(model, batch), batch[2].sum().to(torch.int64)
    x, y = batch
    return F.mse_loss(model(x), y), None


def reference(mode: str) -> torch.nn.Module:
    model = make_model(DTYPE, SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=0.03, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    batches = global_batches(mode)
    for start in range(0, MICRO, N):
        window = batches[start : start + N]
        opt.zero_grad()
        if mode == "sum":
            loss = sum(token_sum(model, b) for b in window) / sum(b[2].sum() for b in window)
        else:
            loss = sum(F.mse_loss(model(x), y) for x, y in window) / len(window)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
    return model


def worker(rank: int, port: int, modes: tuple[str, ...]) -> None:
    torch.set_num_threads(1)  # a forked child must not reuse the parent's OpenMP pool
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=30))
    try:
        for mode in modes:
            check_mode(rank, mode)
    finally:
        dist.destroy_process_group()


def check_mode(rank: int, mode: str) -> None:
    model = torch.nn.parallel.DistributedDataParallel(make_model(DTYPE, SEED))
    opt = torch.optim.AdamW(model.parameters(), lr=0.03, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    # A 64-byte bucket: gradients are folded into the buffers while each backward runs; in sum mode
    # (weight 1) autograd adds into .grad views of the buffers from each window's second micro-step.
    config = GradientAccumulationConfig(
        accumulation_steps=N, max_grad_norm=0.5, loss_normalization=mode, bucket_size_bytes=64, grad_views=mode == "sum"
    )
    acc = GradientAccumulator(model, opt, config, sched)
    reductions, all_reduce = [], dist.all_reduce
    dist.all_reduce = lambda tensor, *a, **k: (reductions.append(tensor.numel()), all_reduce(tensor, *a, **k))[1]
    try:
        for batch in global_batches(mode):
            with acc.micro_step():
                loss, items = loss_and_items(model, shard(batch, rank), mode)
                acc.backward(loss, num_items=items)
        acc.flush()
    finally:
        dist.all_reduce = all_reduce
    # One reduction of the buffers and one of the item count per window (3 windows), none per micro-step.
    assert reductions == [acc._buffers.sizes[DTYPE], 1] * 3
    ref = reference(mode)
    for p, q in zip(model.module.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    assert acc.optimizer_steps == sched.last_epoch == 3
    with pytest.raises(RuntimeError, match="inside `with acc.micro_step\\(\\):`"):
        acc.backward(loss_and_items(model, shard(global_batches(mode)[0], rank), mode)[0])


def run_two_ranks(modes: tuple[str, ...]) -> None:
    # fork (not spawn) when CUDA is untouched: children skip re-importing torch, which dominates the time.
    method = "spawn" if torch.cuda.is_initialized() else "fork"
    ctx = mp.start_processes(worker, args=(free_port(), modes), nprocs=WORLD, join=False, start_method=method)
    deadline = time.monotonic() + 90
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            pytest.fail("DDP workers did not finish within 90 s (a hang)")


@pytest.mark.distributed
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo backend not available")
def test_ddp_two_ranks_equals_full_batch():
    """Mean mode with equal shards, then sum mode with uneven token counts per rank (one process group)."""
    run_two_ranks(("mean", "sum"))
