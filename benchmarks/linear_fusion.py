"""gradient_accumulation_fusion: memory, CPU time and precision of plain loop / hooks path / fused path.

    PYTHONPATH=. python benchmarks/linear_fusion.py              # all three tables, CPU fp32
    PYTHONPATH=. python benchmarks/linear_fusion.py --skip-time  # memory and precision only (deterministic)

Memory: one 4-micro-step window (the optimizer step not included) of the demo's TinyCausalLM (nn.Linear
attention/MLP/head, GPT-2's shape at a small width), fp32 on CPU, under torch.profiler's allocator probe
(gradacc_ext.benchmarking.memory.allocated_bytes): peak and end-of-window bytes above the model, per
trainable parameter (peaks include activations, the same for every contender), and how many allocations
had exactly the size of a fused Linear weight's gradient (a transient dW: the fused path must show none).
Time: mean micro-step of 4-micro-step windows (optimizer step included) at 1 and 2 threads; the machine's
load is recorded with it (timings mean little on a busy machine). Precision: a Linear's window gradient
over 4/16/64 micro-steps against float64, emulating bf16 training on CPU: "hooks path" adds a dW rounded
to bf16 (cuBLAS writes a bf16 C) into fp32, "fused" adds the fp32 GEMM result, "plain bf16 loop" adds
rounded dWs in bf16 (AccumulateGrad in the parameter's dtype). Writes
<date>_linear_fusion_cpu_<commit>.{md,json} under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from gradacc_ext.accumulate.accumulator import GradientAccumulator
from gradacc_ext.accumulate.config import GradientAccumulationConfig
from gradacc_ext.benchmarking.memory import allocated_bytes
from gradacc_ext.cli.demo_data import Batch
from gradacc_ext.cli.demo_model import ModelConfig, TinyCausalLM, token_loss_sum

ROOT = Path(__file__).resolve().parent.parent
CONTENDERS = ("plain loop", "hooks path", "fused path")
MICRO = 4


def build(
    args: argparse.Namespace, contender: str, steps: int, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Module, object]:
    """The model (same seed for all) and what runs a micro-step: the optimizer (plain) or the accumulator."""
    torch.manual_seed(0)
    config = ModelConfig(args.vocab, args.ctx + 1, args.width, args.heads, args.layers)
    model = TinyCausalLM(config).to(device, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if contender == "plain loop":
        return model, opt
    fused = contender == "fused path"
    cfg = GradientAccumulationConfig(
        accumulation_steps=steps, loss_normalization="sum", gradient_accumulation_fusion=fused
    )
    return model, GradientAccumulator(model, opt, cfg)


def batches(args: argparse.Namespace, n: int, shape: tuple[int, int] | None = None, device: str = "cpu") -> list:
    """n micro-batches of `shape` (rows, tokens; default the args' micro-batch and ctx) of random tokens."""
    rows, ctx = shape or (args.micro_batch, args.ctx)
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(1, args.vocab, (rows, ctx + 1), generator=g).to(device) for _ in range(n)]
    return [Batch(t, torch.full((rows,), ctx + 1, device=device)) for t in tokens]


def micro_step(model: torch.nn.Module, runner: object, batch: Batch) -> None:
    if isinstance(runner, GradientAccumulator):
        with runner.micro_step():
            runner.backward(token_loss_sum(model, batch), num_items=batch.inputs.numel())
        return
    (token_loss_sum(model, batch) / (MICRO * batch.inputs.numel())).backward()


def memory_row(args: argparse.Namespace, contender: str, shape: tuple[int, int]) -> dict:
    model, runner = build(args, contender, steps=MICRO + 1)  # the window stays open: no optimizer step inside
    data = batches(args, MICRO, shape)
    n = sum(p.numel() for p in model.parameters())
    linear = {m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)}
    # Sizes of Linear weights that no other parameter shares (the LM head has the token embedding's size).
    weights = {p.numel() * p.element_size() for p in linear} - {
        p.numel() * p.element_size() for p in model.parameters() if p not in linear
    }
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for batch in data:
            micro_step(model, runner, batch)
    peak, end = allocated_bytes(prof)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    dw = sum(1 for e in events if e.nbytes() in weights)  # allocations of a Linear weight's gradient size
    fused = 0
    if isinstance(runner, GradientAccumulator):
        fused = sum(runner.params[i].numel() for i in (runner._fusion.fused if runner._fusion else []))
        runner.close()
    return {
        "contender": contender,
        "shape": shape,
        "params": n,
        "peak": peak,
        "end": end,
        "dw_allocs": dw,
        "fused": fused,
    }


def time_row(args: argparse.Namespace, contenders: tuple[str, ...], threads: int, device: str = "cpu") -> list[dict]:
    """Mean micro-step time per contender, windows interleaved round-robin (load drift hits all alike).

    On CUDA: bf16 parameters (fp32 buffers for the accumulator), synchronised around each window."""
    torch.set_num_threads(threads)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    runs = {c: build(args, c, MICRO, device, dtype) for c in contenders}
    data = batches(args, MICRO, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    times: dict[str, list[float]] = {c: [] for c in contenders}
    for rep in range(args.windows + 1):  # the first window warms up
        for c, (model, runner) in runs.items():
            sync()
            start = time.perf_counter()
            for batch in data:
                micro_step(model, runner, batch)
            if not isinstance(runner, GradientAccumulator):
                runner.step()
                runner.zero_grad(set_to_none=True)
            sync()
            if rep:
                times[c].append((time.perf_counter() - start) / MICRO)
    return [
        {"contender": c, "threads": threads, "device": device, "micro_step_ms": 1e3 * statistics.median(t)}
        for c, t in times.items()
    ]


def precision_rows(
    steps: tuple[int, ...], device: str = "cpu", out_f: int = 256, in_f: int = 256, rows: int = 512
) -> list[dict]:
    """Relative Frobenius error of a window's weight gradient vs float64, for bf16 inputs.

    CPU emulates the bf16 GEMM (fp32 products rounded to bf16); CUDA runs the real kernels: a bf16 torch.mm
    for the hooks path and the plain loop, gradacc.wgrad_addmm_ for the fused path.
    """
    g = torch.Generator().manual_seed(2)
    result = []
    for k in steps:
        ref = torch.zeros(out_f, in_f, dtype=torch.float64, device=device)
        hooks = torch.zeros(out_f, in_f, device=device)
        fused = torch.zeros(out_f, in_f, device=device)
        plain = torch.zeros(out_f, in_f, dtype=torch.bfloat16, device=device)
        for _ in range(k):
            gy = torch.randn(rows, out_f, generator=g).to(device, torch.bfloat16)  # what a bf16 model's tensors hold
            x = torch.randn(rows, in_f, generator=g).to(device, torch.bfloat16)
            ref += gy.double().t() @ x.double()
            if device == "cuda":
                dw = gy.t() @ x  # cuBLAS: fp32 accumulation, bf16 output
                torch.ops.gradacc.wgrad_addmm_(fused, gy.t(), x, 1.0, 1.0)
            else:
                dw = (gy.float().t() @ x.float()).bfloat16()  # the GEMM accumulates in fp32 and writes bf16
                fused.addmm_(gy.float().t(), x.float())  # fused: the fp32 result goes straight into the buffer
            hooks += dw.float()  # today: the hook adds the bf16 dW into the fp32 buffer
            plain += dw  # plain bf16 loop: AccumulateGrad adds in bf16
        norm = ref.norm()
        result.append(
            {
                "micro_steps": k,
                **{
                    name: float((acc.double() - ref).norm() / norm)
                    for name, acc in (("hooks path", hooks), ("fused path", fused), ("plain bf16 loop", plain))
                },
            }
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--ctx", type=int, default=50)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=3)
    parser.add_argument("--windows", type=int, default=3, help="timed windows per contender and thread count")
    parser.add_argument("--skip-time", action="store_true")
    parser.add_argument("--cuda", action="store_true", help="also: bf16 time and the real kernels' precision on CUDA")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Activation-dominated (the default micro-batch) and gradient-dominated (one short sequence) peaks.
    memory = [memory_row(args, c, shape) for shape in ((args.micro_batch, args.ctx), (1, 16)) for c in CONTENDERS]
    timing = [] if args.skip_time else [r for t in (1, 2) for r in time_row(args, CONTENDERS, t)]
    precision = {"cpu": precision_rows((4, 16, 64))}
    if args.cuda:
        timing += time_row(args, CONTENDERS, 1, "cuda")
        precision["cuda"] = precision_rows((4, 16, 64), "cuda")
    write(args, memory, timing, precision)


def write(args: argparse.Namespace, memory: list[dict], timing: list[dict], precision: dict[str, list]) -> None:
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=8", "HEAD"], capture_output=True, text=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    device = "cuda" if args.cuda else "cpu"
    stem = ROOT / "benchmarks" / "results" / f"{stamp}_linear_fusion_{device}_{commit.stdout.strip()}"
    n = memory[0]["params"]
    lines = [
        f"Linear fusion, CPU fp32, torch {torch.__version__}, commit {commit.stdout.strip()}: demo TinyCausalLM, "
        f"{n:,} parameters (width {args.width}, {args.layers} layers, vocab {args.vocab}, ctx {args.ctx}), "
        f"{MICRO} micro-steps. B/param: bytes above the model per parameter; "
        "peaks include activations (the same for all); dW allocs: allocations of a Linear weight's size.",
        "",
        "| micro-batch (rows x tokens) | contender | params fused | peak in window B/param | "
        "held at window end B/param | dW allocs |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in memory:
        rows, ctx = r["shape"]
        lines.append(
            f"| {rows} x {ctx} | {r['contender']} | {r['fused'] / n:.1%} | {r['peak'] / n:.2f} | "
            f"{r['end'] / n:.2f} | {r['dw_allocs']} |"
        )
    cpu_timing = [r for r in timing if r["device"] == "cpu"]
    if cpu_timing:
        load = os.getloadavg()
        lines += [
            "",
            f"CPU fp32 micro-step time (ms, median of {args.windows} windows; load average {load[0]:.2f} "
            f"{load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs: shared machine, indicative only)",
            "",
            "| contender | 1 thread | 2 threads |",
            "|---|---:|---:|",
        ]
        for c in CONTENDERS:
            ms = {r["threads"]: r["micro_step_ms"] for r in cpu_timing if r["contender"] == c}
            lines.append(f"| {c} | {ms[1]:.1f} | {ms[2]:.1f} |")
    cuda_timing = [r for r in timing if r["device"] == "cuda"]
    if cuda_timing:
        lines += ["", f"CUDA ({torch.cuda.get_device_name()}) bf16 params, fp32 buffers: micro-step ms", ""]
        lines += ["| contender | ms |", "|---|---:|"] + [
            f"| {r['contender']} | {r['micro_step_ms']:.2f} |" for r in cuda_timing
        ]
    for dev, rows in precision.items():
        how = "the real kernels on CUDA" if dev == "cuda" else "emulated on CPU"
        lines += [
            "",
            f"Precision: relative error of a 256x256 Linear's window gradient (512 rows per micro-step, bf16 "
            f"inputs) vs float64, {how}",
            "",
            "| micro-steps | hooks path (bf16 dW into fp32) | fused path (fp32 GEMM into fp32) | plain bf16 loop |",
            "|---:|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['micro_steps']} | {r['hooks path']:.2e} | {r['fused path']:.2e} | {r['plain bf16 loop']:.2e} |"
            )
    stem.with_suffix(".json").write_text(
        json.dumps({"args": vars(args), "memory": memory, "timing": timing, "precision": precision}, indent=1)
    )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {stem}.md and .json")


if __name__ == "__main__":
    main()
