"""GradientAccumulator's window end (tail + optimizer step), fused_step on vs off, side by side in one run.

Each contender is an accumulator over the workload's params whose fp32 buffers hold a full
window's (loss-scaled, fp16 mode) gradient sum; the timed call is the window's close, as the last
backward triggers it: reduce (none here), norm, found_inf, clip (L2), the AdamW step, loss-scale
update, release.

* fused tail: config.fused_step=True: one norm pass, then adamw_step_ with loss-scale inverse x
  normaliser x clip coefficient as its grad multiplier (no unscale, no clip pass, no host sync);
* plain tail + torch AdamW(foreach): fused_step=False: unscale_ + norm, clip_by_norm_, then
  torch's AdamW with a host read of found_inf (the accumulator's tail before this change);
* plain tail + torch AdamW(fused): the same passes, torch's fused step skips on the device;
* with --bf16: bf16 params, FusedAdamW (master weights), fused tail vs plain tail (which makes
  bf16 cast copies of the fp32 buffers for the step).

Every contender starts from the same params and buffer contents each round (the buffers are
refilled outside the timed call). Medians of --repeats interleaved rounds; figures depend on
the machine: say which when you quote them.

    PYTHONPATH=. python benchmarks/accumulator_tail.py --workload gpt2-small --scale 0.25 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from gradacc_ext.accumulate.accumulator import GradientAccumulator
from gradacc_ext.accumulate.config import GradientAccumulationConfig
from gradacc_ext.benchmarking.workloads import WORKLOADS, make_workload
from gradacc_ext.optim import FusedAdamW

LR, MAX_NORM, LOSS_SCALE, STEPS = 1e-4, 1.0, 1024.0, 4


def make_tail(shapes, dtype: torch.dtype, optimizer: Callable, fused_step: bool) -> Callable[[], float]:
    """An accumulator whose window is full; returns a function timing one window close (seconds)."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]
    config = GradientAccumulationConfig(
        accumulation_steps=STEPS, mixed_precision="fp16", init_scale=LOSS_SCALE, max_grad_norm=MAX_NORM,
        fused_step=fused_step, growth_interval=10**6, grad_norm_history=0,
    )  # fmt: skip
    acc = GradientAccumulator(params, optimizer(params), config)
    acc._buffers._ensure()
    sums = {d: torch.randn(f.shape, generator=g) * LOSS_SCALE for d, f in acc._buffers.flats.items()}

    def close_once() -> float:
        b, window = acc._buffers, acc._window
        for d, f in b.flats.items():
            f.copy_(sums[d])
        b.sums.restore([True] * len(params))
        for _ in range(STEPS):
            window.commit(False, 1.0, completes_micro_batch=True)
        start = time.perf_counter()
        acc._end.close(window)
        acc.synchronize()  # the deferred outcome's host read belongs to this window's cost
        return time.perf_counter() - start

    return close_once


def contenders(bf16: bool) -> dict[str, tuple[torch.dtype, Callable, bool]]:
    out = {
        "fused tail (fused_step=True)": (torch.float32, lambda p: torch.optim.AdamW(p, lr=LR), True),
        "plain tail + AdamW(foreach)": (torch.float32, lambda p: torch.optim.AdamW(p, lr=LR, foreach=True), False),
        "plain tail + AdamW(fused)": (torch.float32, lambda p: torch.optim.AdamW(p, lr=LR, fused=True), False),
    }
    if bf16:
        out["bf16 params: fused tail, FusedAdamW"] = (torch.bfloat16, lambda p: FusedAdamW(p, lr=LR), True)
        out["bf16 params: plain tail, FusedAdamW"] = (torch.bfloat16, lambda p: FusedAdamW(p, lr=LR), False)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=[k for k in WORKLOADS if k != "huge"], default="gpt2-small")
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bf16", action="store_true", help="also bf16 params with FusedAdamW, both tails")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    workload = make_workload(args.workload, args.scale)
    print(f"{workload.name}: {workload.summary()}; {args.threads} thread(s); torch {torch.__version__}")
    fns = {name: make_tail(workload.shapes, *spec) for name, spec in contenders(args.bf16).items()}
    for fn in fns.values():
        fn()  # warm-up: optimizer state, first touch
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.repeats):  # interleaved rounds: load changes on a shared machine hit all alike
        for name, fn in fns.items():
            times[name].append(fn())
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    base = ms["plain tail + AdamW(foreach)"]
    print(f"{'contender':40s} {'ms':>9s} {'vs plain+foreach':>17s}")
    for name, value in ms.items():
        print(f"{name:40s} {value:9.1f} {base / value:16.2f}x")


if __name__ == "__main__":
    main()
