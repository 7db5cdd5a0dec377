"""gradacc_ext.utils against torch.nn.utils' foreach path, one row per function and workload.

    python benchmarks/clip_utils.py                                  # CPU, one thread
    python benchmarks/clip_utils.py --device cuda --workloads gpt2-small,small-2000

Median milliseconds per call (torch.utils.benchmark's blocked_autorange; it synchronises CUDA) on a
workload's fp32 grads. Each pair is first checked for agreement. Prints a markdown table and writes it
to benchmarks/results/<date>_clip_utils_<device>.md.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch
import torch.nn.utils as tnu
from torch.utils.benchmark import Timer

from gradacc_ext import utils
from gradacc_ext.benchmarking import parse_workloads

RESULTS = Path(__file__).resolve().parent / "results"
SHRINK = 0.999  # clip by a coefficient just below 1: real work every call, no drift into subnormals


def params_for(shapes, device: torch.device, seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.empty(shape, device=device))
        p.grad = torch.randn(shape, generator=gen).to(device)
        params.append(p)
    return params


def calls(module, params: list[torch.nn.Parameter], norm: float) -> dict[str, object]:
    grads = [p.grad for p in params]
    total = torch.tensor(norm / SHRINK, device=grads[0].device)
    return {
        "clip_grad_norm_": lambda: module.clip_grad_norm_(params, norm * SHRINK, foreach=True),
        "get_total_norm": lambda: module.get_total_norm(grads, foreach=True),
        "clip_grads_with_norm_": lambda: module.clip_grads_with_norm_(params, norm, total, foreach=True),
        "clip_grad_value_": lambda: module.clip_grad_value_(params, 1.5, foreach=True),
    }


def median_ms(fn, min_run_time: float) -> float:
    return Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workloads", default="gpt2-small=0.25,small-2000")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--min-run-time", type=float, default=0.5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    rows = [
        "| workload | function | gradacc_ext.utils | torch.nn.utils (foreach) | speedup |",
        "|---|---|---:|---:|---:|",
    ]
    for workload in parse_workloads(args.workloads):
        ours_p, theirs_p = params_for(workload.shapes, device, 0), params_for(workload.shapes, device, 0)
        norm = float(tnu.get_total_norm([p.grad for p in theirs_p]))
        ours, theirs = calls(utils, ours_p, norm), calls(tnu, theirs_p, norm)
        for name in ours:  # all checked before any is timed: timing changes the grads a different number of times
            got, want = ours[name](), theirs[name]()
            # torch's fp32 foreach norm of a 2M-element tensor is ~1e-5 off the float64 norm (ours ~1e-7)
            if want is not None:
                torch.testing.assert_close(got, want, rtol=1e-4, atol=0.0)
            for a, b in zip(ours_p, theirs_p, strict=True):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)
        for name in ours:
            t_ours, t_theirs = median_ms(ours[name], args.min_run_time), median_ms(theirs[name], args.min_run_time)
            cells = [f"{workload.name}@{workload.scale:g}", name, f"{t_ours:.2f}", f"{t_theirs:.2f}"]
            rows.append("| " + " | ".join(cells) + f" | {t_theirs / t_ours:.2f}x |")
            print(rows[-1], flush=True)

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    header = (
        f"gradacc_ext.utils vs torch.nn.utils, {device.type}, {args.threads} thread(s), torch {torch.__version__}, "
        f"{stamp} UTC; median ms per call, fp32 grads\n\n"
    )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{stamp}_clip_utils_{device.type}.md"
    out.write_text(header + "\n".join(rows) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
