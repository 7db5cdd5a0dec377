"""Data-parallel accumulation on CPU/gloo: window time and peak memory per rank, plain loops vs gradacc.

    python benchmarks/distributed.py                 # 2 ranks, writes benchmarks/results/distributed_cpu.{md,json}
    python benchmarks/distributed.py --world 2 --windows 6 --width 512 --layers 6

Contenders (same model, data and window on every rank):
  ddp-plain-no_sync      DDP(model) defaults, no_sync on non-final micro-steps, autograd accumulates .grad
                         (DDP's reducer, overlapped)
  ddp-plain-no_sync-bf16 the same with a bf16 comm hook (torch's bf16_compress_hook, which torch allows on GPUs only)
  ddp-gradacc-buffer     GradientAccumulator, whole-buffer all-reduce after the last backward (the default)
  ddp-gradacc-buffer-bf16   the same, communicating in bf16 (in chunks of the largest gradient)
  ddp-gradacc-overlap    GradientAccumulator, ddp_reduce="overlap" (DDP's reducer over the buffers)
  ddp-gradacc-overlap-bf16  the same, communicating in bf16 (one bf16 copy of each DDP bucket, as the plain hook)
  fsdp-plain-window      fully_shard, set_requires_gradient_sync(False) until the last micro-step
  fsdp-plain-every       fully_shard, reduce-scatter every micro-step, FSDP accumulates sharded grads
  fsdp-gradacc-micro_step / fsdp-gradacc-window   GradientAccumulator with fsdp_reduce set so
  hsdp-* (2-D mesh, --world 4): plain-every (reduce-scatter + all-reduce every micro-step), plain-deferred
    (set_requires_all_reduce(False) until the last), gradacc-micro_step, gradacc-window

    python benchmarks/distributed.py --world 4 --contenders hsdp-plain-every hsdp-plain-deferred \
        hsdp-gradacc-micro_step hsdp-gradacc-window --out benchmarks/results/distributed_cpu_hsdp4

Window time: median wall time of a window (all micro-steps, the reduction, clipping and the
optimizer step) over the timed windows, rank 0's clock after a barrier. Peak memory: the
gradient storage held between windows (gradacc's flat buffers; a plain loop's .grad, None
after zero_grad) plus the peak of CPU allocations above the window's start, from every
allocation and free torch.profiler records ("[memory]" events), over one extra profiled
window; it holds activations and all-gathered parameters (equal for all contenders of a
wrapper) plus gradients and communication buffers. DDP's reducer allocates its buckets (the size of
the gradient) when the model is wrapped, the same for every DDP contender: they are in no row.
On a one-machine CPU run the ranks share the cores, so communication cannot truly overlap
compute; a one-GPU run cannot show cross-rank overlap either. Multi-GPU NCCL runs are needed for that and were not done.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.profiler import ProfilerActivity, profile

from gradacc_ext import GradientAccumulationConfig, GradientAccumulator
from gradacc_ext.benchmarking.memory import allocated_bytes

STEPS, MICRO_BATCH = 4, 32
CONTENDERS = (
    "ddp-plain-no_sync",
    "ddp-plain-no_sync-bf16",
    "ddp-gradacc-buffer",
    "ddp-gradacc-buffer-bf16",
    "ddp-gradacc-overlap",
    "ddp-gradacc-overlap-bf16",
    "fsdp-plain-window",
    "fsdp-plain-every",
    "fsdp-gradacc-micro_step",
    "fsdp-gradacc-window",
)
HSDP = ("hsdp-plain-every", "hsdp-plain-deferred", "hsdp-gradacc-micro_step", "hsdp-gradacc-window")


def make_model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1))


def bf16_hook(group, bucket):  # unannotated: DDP checks a hook's annotations
    """torch's bf16_compress_hook (average in bf16, fp32 result), without its GPU-only check."""
    buffer = bucket.buffer()
    low = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))

    def back(fut: torch.futures.Future) -> torch.Tensor:
        return buffer.copy_(fut.value()[0])

    return dist.all_reduce(low, group=group, async_op=True).get_future().then(back)


def build(name: str, width: int, layers: int, world: int):
    """(window function running one window on the given micro-batches, gradient bytes it holds between windows)."""
    model = make_model(width, layers)
    if name.startswith("ddp"):
        model = torch.nn.parallel.DistributedDataParallel(model)
        if name == "ddp-plain-no_sync-bf16":
            model.register_comm_hook(None, bf16_hook)
    else:
        hsdp = name.startswith("hsdp")
        shape, names = ((2, world // 2), ("replicate", "shard")) if hsdp else ((world,), None)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for m in [*model[:-1:2], model[-1], model]:
            fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if "gradacc" in name:
        kind = name.split("-")[2]
        config = GradientAccumulationConfig(
            accumulation_steps=STEPS,
            max_grad_norm=1.0,
            ddp_reduce="overlap" if kind == "overlap" else "buffer",
            comm_dtype=torch.bfloat16 if name.endswith("bf16") else None,
            fsdp_reduce=kind if not name.startswith("ddp") else "micro_step",
        )
        acc = GradientAccumulator(model, opt, config)

        def window(batches):
            for x, y in batches:
                with acc.micro_step():
                    acc.backward(torch.nn.functional.mse_loss(model(x), y))

        return window, lambda: sum(f.nbytes for f in acc._buffers.flats.values())

    def plain(batches):
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            if name.startswith("ddp-plain-no_sync"):
                ctx = model.no_sync() if not last else contextlib.nullcontext()
            else:
                model.set_requires_gradient_sync(last or name.endswith(("-every", "-deferred")))
                if name == "hsdp-plain-deferred":
                    model.set_requires_all_reduce(last)
                ctx = contextlib.nullcontext()
            with ctx:
                loss = torch.nn.functional.mse_loss(model(x), y)  # held through backward, as acc.backward(loss) does
                (loss / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return plain, lambda: sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)


def worker(rank: int, world: int, port: int, args, queue) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(MICRO_BATCH, args.width, generator=g), torch.randn(MICRO_BATCH, 1, generator=g))] * STEPS
    rows = {}
    for name in args.contenders:
        window, held = build(name, args.width, args.layers, world)
        times = []
        for w in range(args.warmup + args.windows):
            dist.barrier()
            start = time.perf_counter()
            window(data)
            dist.barrier()
            if w >= args.warmup:
                times.append(time.perf_counter() - start)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            window(data)
        peaks = [None] * world
        dist.all_gather_object(peaks, held() + allocated_bytes(prof)[0])
        rows[name] = {
            "window_ms": 1e3 * statistics.median(times),
            "window_ms_min": 1e3 * min(times),
            "peak_mib": [p / 2**20 for p in peaks],
        }
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS + HSDP)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "distributed_cpu")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    mp.start_processes(worker, args=(args.world, port, args, queue), nprocs=args.world, start_method="fork")
    rows = queue.get()
    params = sum(p.numel() for p in make_model(args.width, args.layers).parameters())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {
        "world": args.world,
        "params": params,
        "grad_mib_fp32": params * 4 / 2**20,
        "micro_steps": STEPS,
        "micro_batch": MICRO_BATCH,
        "timed_windows": args.windows,
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, gloo on 127.0.0.1, 1 thread per rank",
        "commit": commit,
    }
    lines = [
        f"{args.world} ranks, {params:,} params ({meta['grad_mib_fp32']:.2f} MiB fp32 gradient), {STEPS} micro-steps "
        f"of {MICRO_BATCH} rows per rank; {meta['machine']}; torch {torch.__version__}; commit {commit}",
        "",
        "| contender | window ms (median) | min | peak MiB per rank (held buffers + peak above window start) |",
        "|---|---:|---:|---|",
    ]
    for name, row in rows.items():
        peaks = ", ".join(f"{p:.2f}" for p in row["peak_mib"])
        lines.append(f"| {name} | {row['window_ms']:.1f} | {row['window_ms_min']:.1f} | {peaks} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    sys.exit(0)


if __name__ == "__main__":
    main()
