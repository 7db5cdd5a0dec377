"""Multi-process helpers: launch gloo ranks on 127.0.0.1 with a bounded time, shard data, a full-batch reference.

Workers compare their (gathered) parameters with a plain single-process loop
over the whole effective batch that each rank computes itself.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

IN, HIDDEN, OUT = 5, 7, 3
STEPS, MICRO, LR = 3, 7, 0.03  # windows of 3 micro-batches: 3, 3 and a short 1
TOL64 = dict(rtol=1e-9, atol=1e-11)

needs_gloo = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="gloo backend not available"
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, agent_store: bool) -> None:
    torch.set_num_threads(1)  # a forked child must not reuse the parent's OpenMP pool
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    # agent_store: a client of the launcher's store; otherwise rank 0 hosts it (env:// without torchrun).
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False) if agent_store else None
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60), store=store)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def _host_store(port: int, world: int) -> None:
    """The c10d store in a process of its own, as torchrun's agent hosts it: it outlives every worker.

    Not in the test process: a store server's thread there would be running when the workers fork.
    """
    server = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False)  # noqa: F841
    time.sleep(3600)  # serving, until launch() kills this process


def launch(fn: Callable, world: int, *args, timeout: float = 120, agent_store: bool = False) -> None:
    """Runs fn(rank, world, *args) in `world` processes; a worker error or a hang fails the test.

    agent_store: a separate process hosts the c10d store (as torchrun's agent does), so it outlives any worker.
    """
    port = free_port()
    # fork (not spawn) when CUDA is untouched: children skip re-importing torch, which dominates the time.
    method = "spawn" if torch.cuda.is_initialized() else "fork"
    host = mp.get_context(method).Process(target=_host_store, args=(port, world), daemon=True) if agent_store else None
    if host is not None:
        host.start()
    try:
        ctx = mp.start_processes(
            _entry, args=(world, port, fn, args, agent_store), nprocs=world, join=False, start_method=method
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for process in ctx.processes:
                    process.kill()
                pytest.fail(f"{world} workers did not finish within {timeout} s (a hang)")
    finally:
        if host is not None:
            host.kill()
            host.join()


def make_model(dtype: torch.dtype = torch.float64, seed: int = 11) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT)).to(dtype)


def fsdp_model(mesh, dtype=torch.float64, mp_policy: MixedPrecisionPolicy | None = None, make=make_model):
    model = make(dtype)
    kwargs = {"mesh": mesh, **({"mp_policy": mp_policy} if mp_policy else {})}
    for module in (*(m for m in model if isinstance(m, torch.nn.Linear)), model):
        fully_shard(module, **kwargs)
    return model


class Items(NamedTuple):
    """A micro-batch of kind "items": each rank holds its own number of rows (1 to 4); a rank's loss is the
    mean over its rows and num_items its row count (a device tensor on odd micro-batches, else an int)."""

    x: torch.Tensor
    y: torch.Tensor
    stops: tuple[int, ...]  # rank r holds rows stops[r - 1]:stops[r]
    tensor_items: bool


def global_batches(kind: str, world: int, seed: int, dtype: torch.dtype = torch.float64) -> list[tuple]:
    """MICRO global micro-batches: "mean": 2 rows per rank; "sum": 2 padded sequences per rank, uneven tokens;
    "items": uneven rows per rank (Items), weighted by num_items in "mean" mode."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(MICRO):
        if kind == "items":
            stops = tuple(torch.randint(1, 5, (world,), generator=g).cumsum(0).tolist())
            x, y = torch.randn(stops[-1], IN, generator=g), torch.randn(stops[-1], OUT, generator=g)
            out.append(Items(x.to(dtype), y.to(dtype), stops, i % 2 == 1))
            continue
        if kind == "mean":
            out.append((torch.randn(2 * world, IN, generator=g, dtype=dtype), torch.randn(2 * world, OUT, generator=g)))
            continue
        lengths = torch.randint(1, 7, (2 * world,), generator=g)
        mask = (torch.arange(6)[None, :] < lengths[:, None]).to(dtype)
        x, y = torch.randn(2 * world, 6, IN, generator=g, dtype=dtype), torch.randn(2 * world, 6, OUT, generator=g)
        out.append((x, y.to(dtype), mask))
    return [b if isinstance(b, Items) else tuple(t.to(dtype) for t in b) for b in out]


def shard(batch: tuple, rank: int) -> tuple:
    if isinstance(batch, Items):
        start, stop = batch.stops[rank - 1] if rank else 0, batch.stops[rank]
        return batch._replace(x=batch.x[start:stop], y=batch.y[start:stop], stops=(stop - start,))
    return tuple(t[2 * rank : 2 * rank + 2] for t in batch)


def loss_and_items(model: torch.nn.Module, batch: tuple) -> tuple[torch.Tensor, int | torch.Tensor | None]:
    if isinstance(batch, Items):
        rows = len(batch.x)
        return torch.nn.functional.mse_loss(model(batch.x), batch.y), torch.tensor(rows) if batch.tensor_items else rows
    if len(batch) == 3:
        x, y, mask = batch
        return (((model(x) - y) ** 2).sum(-1) * mask).sum(), int(mask.sum())
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y), None


def make_optimizer(params, sgd: bool = False) -> torch.optim.Optimizer:
    if sgd:
        return torch.optim.SGD(params, lr=LR * 10, momentum=0.9)
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def reference(
    kind: str,
    world: int,
    seed: int,
    skip: int | None = None,
    dtype=torch.float64,
    sgd=False,
    norm_type=2.0,
    make: Callable[[torch.dtype], torch.nn.Module] = make_model,
):
    """The plain loop on one process over each window's whole batch; window `skip` is skipped (overflow)."""
    model = make(dtype)
    opt = make_optimizer(model.parameters(), sgd)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    batches = global_batches(kind, world, seed, dtype)
    for w, start in enumerate(range(0, MICRO, STEPS)):
        if w == skip:
            continue
        window = batches[start : start + STEPS]
        opt.zero_grad()
        if kind == "sum":
            loss = sum(loss_and_items(model, b)[0] for b in window) / sum(b[2].sum() for b in window)
        elif kind == "items":  # the mean over all rows of all ranks in the window
            x, y = torch.cat([b.x for b in window]), torch.cat([b.y for b in window])
            loss = torch.nn.functional.mse_loss(model(x), y)
        else:
            loss = sum(loss_and_items(model, b)[0] for b in window) / len(window)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type)
        opt.step()
        sched.step()
    return model


def full_params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in model.parameters()]


def assert_params_equal(model: torch.nn.Module, ref: torch.nn.Module, **tol) -> None:
    for p, q in zip(full_params(model), full_params(ref), strict=True):
        torch.testing.assert_close(p, q, **(tol or TOL64))


def dcp_save(model: torch.nn.Module, opt: torch.optim.Optimizer, acc, ckpt: str) -> None:
    """A sharded checkpoint of model, optimizer and accumulator through torch.distributed.checkpoint."""
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "acc": acc.state_dict()}, checkpoint_id=ckpt)


def dcp_load(model: torch.nn.Module, opt: torch.optim.Optimizer, acc, ckpt: str) -> None:
    """Loads what dcp_save wrote into freshly built model, optimizer and accumulator."""
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "acc": acc.state_dict()}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    acc.load_state_dict(state["acc"])
