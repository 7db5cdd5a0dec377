r"""Per-call and per-tensor overhead of the raw ops against torch eager, on many small tensors.

The stable-ABI binding pays a few shim calls per tensor per op call (docs/stable-abi.md, "Overhead,
before and after"); this prints what one call and one tensor cost for `torch.ops.gradacc.<op>` and
for eager's equivalent side by side (accumulate_: `torch._foreach_add_`; unscale_: GradScaler's
`torch._amp_foreach_non_finite_check_and_unscale_`), so both are timed on the same tensors. Per tensor means
per list item: one tensor for unscale_, one (buf, grad) pair for accumulate_.

Wall clock (median over rounds) on a quiet machine:
    python benchmarks/op_overhead.py --tensors 2000 --numel 16 --calls 300
Instruction counts (load-independent): benchmarks/op_instructions.py, which runs the same calls under
callgrind and prints instructions per call and per list item (docs/stable-abi.md, "Host cost per tensor").
To time another tree (an older commit's build) side by side, run this file with that tree first on the path:
    PYTHONPATH=/path/to/tree python benchmarks/op_overhead.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import gradacc_ext.ops as gops


def calls(op: str, impl: str, n: int, numel: int) -> Callable[[], None]:
    """One call of `op` by `impl` over n fp32 tensors (and n grads) of numel elements: "raw" is
    `torch.ops.gradacc.<op>`, "public" `gradacc_ext.ops.<op>` (the Python checks too: what users call)."""
    bufs = [torch.randn(numel) for _ in range(n)]
    grads = [torch.randn(numel) for _ in range(n)]
    inv_scale, found_inf = torch.ones(1), torch.zeros(1)  # x1: the values stay finite however often it runs
    if op == "accumulate_":
        if impl == "raw":
            return lambda: torch.ops.gradacc.accumulate_(bufs, grads, 1.0, None, False)
        if impl == "public":
            return lambda: gops.accumulate_(bufs, grads, 1.0)
        return lambda: torch._foreach_add_(bufs, grads)
    if impl == "raw":
        return lambda: torch.ops.gradacc.unscale_(bufs, inv_scale, found_inf)
    if impl == "public":
        return lambda: gops.unscale_(bufs, inv_scale, found_inf)
    return lambda: torch._amp_foreach_non_finite_check_and_unscale_(bufs, found_inf, inv_scale)


def per_call_us(fn: Callable[[], None], calls_per_round: int, rounds: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(calls_per_round):
            fn()
        times.append((time.perf_counter_ns() - start) / calls_per_round / 1e3)
    return statistics.median(times) if times else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=2000, help="tensors per list (default: %(default)s)")
    parser.add_argument("--numel", type=int, default=16, help="elements per tensor (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=300, help="calls per round (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds, median printed (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls first (default: %(default)s)")
    parser.add_argument("--op", choices=["accumulate_", "unscale_"], action="append", help="default: both")
    parser.add_argument("--impl", choices=["raw", "public", "eager"], action="append", help="default: all three")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    args = parser.parse_args()
    if not hasattr(torch.ops.gradacc, "accumulate_"):  # asked of torch, so that older trees run this too
        raise SystemExit("gradacc_ext._C is not loaded: nothing to measure")
    torch.set_num_threads(args.threads)
    impls = args.impl or ["raw", "public", "eager"]
    print(
        f"{args.tensors} fp32 tensors of {args.numel}, {args.threads} thread(s), median of {args.rounds} x "
        f"{args.calls} calls"
    )
    for op in args.op or ["accumulate_", "unscale_"]:
        row = []
        for impl in impls:
            us = per_call_us(calls(op, impl, args.tensors, args.numel), args.calls, args.rounds, args.warmup)
            row.append(f"{impl} {us:9.1f} us/call {us * 1e3 / max(args.tensors, 1):7.1f} ns/tensor")
        print(f"{op:12s} " + " | ".join(row))


if __name__ == "__main__":
    main()
