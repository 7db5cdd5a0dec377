"""Optimizer step time per state storage, side by side in one run (issue 30's speed table).

    python benchmarks/state_speed.py --threads 1
    python benchmarks/state_speed.py --threads 2 --contenders "FusedAdamW int8 states" "torch AdamW (foreach)"

The GPT-shaped parameter set of benchmarks/fused_step.py (gradacc_ext.benchmarking's gpt2-small at --scale), as
bf16 params whose fp32 .grad holds a window's accumulated sums, the state after one warm-up step. Each row times
one optimizer step with the global L2 norm clipped to 1.0 the way that optimizer is used:

* FusedAdamW (stochastic rounding, no master weights) with fp32, bf16 and int8 states: ``max_grad_norm`` folds
  the clip into the step (one norm pass over the grads, then the one step pass);
* torch AdamW (foreach) and torchao's AdamW8bit, eager and compiled (torchao compiles its per-param step
  itself), each after ``torch.nn.utils.clip_grad_norm_(foreach=True)``. torch's optimizers need a grad of the
  param's dtype, so their .grad is the bf16 rounding of the same sums (2 B/param read instead of 4).

Columns: median ms over --repeats interleaved rounds (on a shared machine, load changes hit every row alike),
the B/param the row's passes must move (BYTES below; "–" where the peer's passes are its own) and the GB/s that
makes. Load average printed beside: time on a quiet machine. Writes <date>_state_speed_cpu_<commit>.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
from optimizer_contenders import BETAS, CONTENDERS, EPS, WEIGHT_DECAY, Contender, versions

from gradacc_ext.benchmarking.workloads import make_workload
from gradacc_ext.optim import FusedAdamW

ROOT = Path(__file__).resolve().parent.parent
LR, MAX_NORM = 1e-4, 1.0
SCALES = 2 * 4 / 256  # int8: two moments' float32 absmax per 256 elements, read and written: 2 x (4/256) each way
# Bytes per param one step moves, by its passes: the norm reads the grads (4, fp32 sums), then the step reads
# param 2, grad 4 and the moments, and writes param 2 and the moments.
BYTES: dict[str, float | None] = {
    "FusedAdamW fp32 states": 4 + (2 + 4 + 8) + (2 + 8),
    "FusedAdamW bf16 states": 4 + (2 + 4 + 4) + (2 + 4),
    "FusedAdamW int8 states": 4 + (2 + 4 + 2) + (2 + 2) + 2 * SCALES,
    "torch AdamW (foreach)": None,
    "torchao AdamW8bit eager": None,
    "torchao AdamW8bit compiled": None,
}
DEFAULT = list(BYTES)


def _fused(state_dtype: str) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    def build(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        extra = {} if state_dtype == "fp32" else {"state_dtype": state_dtype}
        return FusedAdamW(
            params, LR, BETAS, EPS, WEIGHT_DECAY, param_mode="stochastic", max_grad_norm=MAX_NORM, **extra
        )

    return build


FUSED = {f"FusedAdamW {s} states": _fused(s) for s in ("fp32", "bf16", "int8")}


def step_fn(name: str, contender: Contender, params: list[torch.nn.Parameter]) -> Callable[[], None]:
    """One clipped step of `name` over `params` (whose .grad is set)."""
    if name in FUSED:
        opt = FUSED[name](params)
        return opt.step
    opt = contender.build(params, LR)

    def run() -> None:
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        opt.step()

    return run


def make_params(shapes, sums: list[torch.Tensor], fp32_grads: bool) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).bfloat16()) for s in shapes]
    for p, s in zip(params, sums, strict=True):
        if fp32_grads and hasattr(p, "grad_dtype"):
            p.grad_dtype = None  # torch >= 2.10 checks a .grad's dtype against the param's unless told otherwise
        p.grad = s.clone() if fp32_grads else s.bfloat16()
    return params


def measure(names: list[str], args: argparse.Namespace) -> tuple[dict[str, list[float] | str], int]:
    workload = make_workload("gpt2-small", args.scale)
    g = torch.Generator().manual_seed(1)
    sums = [torch.randn(s, generator=g) * 1e-2 for s in workload.shapes]
    fns: dict[str, Callable[[], None]] = {}
    out: dict[str, list[float] | str] = {}
    for name in names:
        contender = CONTENDERS[name]
        why = contender.missing()
        if why is not None:
            out[name] = why
            continue
        params = make_params(workload.shapes, sums, fp32_grads=name in FUSED)
        fn = step_fn(name, contender, params)
        try:
            with contender.stepping(), torch.no_grad():
                fn()  # the state exists after the first step (and a compiled step has compiled)
                fn()
        except Exception as error:  # a peer's CPU path may not run here: the row says how it failed
            out[name] = f"failed: {type(error).__name__}: {error}"
            continue
        fns[name] = fn
        out[name] = []
    for _ in range(args.repeats):
        for name, fn in fns.items():
            with CONTENDERS[name].stepping(), torch.no_grad():
                start = time.perf_counter()
                fn()
                out[name].append(time.perf_counter() - start)  # type: ignore[union-attr]
    return out, workload.numel


def table(results: dict[str, list[float] | str], numel: int) -> list[str]:
    lines = [
        "| optimizer (clip to 1.0) | ms | vs FusedAdamW fp32 states | B/param moved | GB/s |",
        "|---|---:|---:|---:|---:|",
    ]
    base = results.get("FusedAdamW fp32 states")
    base_ms = 1e3 * statistics.median(base) if isinstance(base, list) and base else None
    for name, r in results.items():
        if isinstance(r, str):
            lines.append(f"| {name} | {r} ||||")
            continue
        ms = 1e3 * statistics.median(r)
        moved = BYTES.get(name)
        ratio = f"{ms / base_ms:.2f}x" if base_ms else "–"
        gbps = f"{moved * numel / ms / 1e6:.2f}" if moved else "–"
        lines.append(f"| {name} | {ms:.1f} | {ratio} | {f'{moved:.2f}' if moved else '–'} | {gbps} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=0.25, help="gpt2-small's width scale, as fused_step.py")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--contenders", nargs="+", choices=DEFAULT, default=DEFAULT)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    results, numel = measure(args.contenders, args)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=8", "HEAD"], capture_output=True, text=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    found = ", ".join(f"{k} {v}" for k, v in versions().items())
    head = (
        f"Optimizer step per state storage, CPU, {args.threads} thread(s), {now:%Y-%m-%d %H:%M} UTC, commit "
        f"{commit.stdout.strip()}, {found}; gpt2-small x {args.scale}: {numel:,} bf16 params; median of "
        f"{args.repeats} interleaved rounds; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after."
    )
    lines = [head, "", *table(results, numel)]
    print("\n".join(lines))
    if not args.no_write:
        name = f"{now:%Y%m%d-%H%M%S}_state_speed_cpu_t{args.threads}_{commit.stdout.strip()}.md"
        path = ROOT / "benchmarks" / "results" / name
        path.write_text("\n".join(lines) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
