"""`gradacc bench`: the benchmark table of this machine, within a minute on 2 CPU cores."""

from __future__ import annotations

import argparse
import sys

from .args import DEVICES, int_at_least, resolve_device

DEFAULT_THREADS = 1  # on a shared machine one thread times steadily; give the core count for the parallel kernels


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=DEVICES, default="auto", help="auto: cuda when available, else cpu")
    p.add_argument("--quick", action="store_true", help="two operations, gradacc against torch eager, shorter timing")
    p.add_argument(
        "--threads", type=int_at_least(1), default=DEFAULT_THREADS, metavar="N", help="torch CPU threads for the run"
    )


def cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .. import benchmarking

    device = resolve_device(parser, args.device)
    mode = "quick run" if args.quick else "run"
    print(
        f"gradacc bench: {mode} on {device}, {args.threads} CPU thread{'s' if args.threads > 1 else ''} "
        "(the full harness: python benchmarks/compare.py)",
        file=sys.stderr,
        flush=True,
    )
    print(benchmarking.cli_table(str(device), quick=args.quick, threads=args.threads))
    return 0
