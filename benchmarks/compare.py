"""Runs every benchmark cell side by side in one run and prints one comparison table.

    python benchmarks/compare.py                      # this machine's defaults (see --help)
    python benchmarks/compare.py --device cuda        # the full-size GPU run, targets evaluated
    python benchmarks/compare.py --workloads gpt2-small=0.25,small-2000 --no-compile

Writes <date>_<device>_torch<version>_<commit>.{json,md,png} under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

from gradacc_ext.benchmarking import (
    IMPLS,
    OPERATIONS,
    BenchConfig,
    TimingConfig,
    default_device,
    markdown,
    parse_operations,
    parse_workloads,
    run,
    write,
)

RESULTS = Path(__file__).resolve().parent / "results"
# Full size on a GPU. On a CPU (2 cores, ~20 GB) the large sets are scaled so a run takes minutes.
DEFAULT_WORKLOADS = {
    "cuda": "gpt2-small,gpt-1.3b,small-2000,huge",
    "cpu": "gpt2-small=0.25,gpt-1.3b=0.125,small-2000",
}
DEFAULT_TIMING = {
    "cuda": TimingConfig(threshold=0.02, min_time_s=0.5, max_time_s=5.0),
    "cpu": TimingConfig(threshold=0.05, min_time_s=0.5, max_time_s=3.0),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=default_device(), help="cpu or cuda[:N] (default: %(default)s)")
    p.add_argument(
        "--workloads",
        help="comma list of name[=scale] from gpt2-small, gpt-1.3b, small-2000, huge (GPU only); "
        f"default on cuda: {DEFAULT_WORKLOADS['cuda']}; on cpu: {DEFAULT_WORKLOADS['cpu']}",
    )
    p.add_argument("--scale", type=float, default=1.0, help="scale of workloads given without =scale")
    p.add_argument("--ops", default=",".join(OPERATIONS), help="operations (default: %(default)s)")
    p.add_argument("--impls", default=",".join(IMPLS), help="implementations (default: %(default)s)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (minutes of compiling on a CPU)")
    p.add_argument("--threshold", type=float, help="stop timing a cell once its blocks' IQR/median is below this")
    p.add_argument("--min-time", type=float, help="seconds timed at least per implementation")
    p.add_argument("--max-time", type=float, help="seconds timed at most per implementation")
    p.add_argument(
        "--rounds", type=int, help="turns per implementation, taken in alternation with the others (default 3)"
    )
    p.add_argument("--copy-mib", type=int, help="MiB of each roofline stream (default: as large as the input sets)")
    p.add_argument(
        "--compile-max-tensors",
        type=int,
        default=1000,
        help="skip torch.compile on workloads with more tensors (compiling 2,000 tensors takes many minutes)",
    )
    p.add_argument("--huge-peers", action="store_true", help="also run eager/compile on the > 2**31-element tensor")
    p.add_argument("--out-dir", type=Path, default=RESULTS, help="where results go (default: benchmarks/results)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--threads", type=int, help="torch.set_num_threads for the run (CPU; default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    device = torch.device(args.device)
    base = DEFAULT_TIMING["cuda" if device.type == "cuda" else "cpu"]
    timing = replace(
        base,
        threshold=args.threshold or base.threshold,
        min_time_s=base.min_time_s if args.min_time is None else args.min_time,
        max_time_s=max(args.max_time or base.max_time_s, args.min_time or 0.0),
        threads=args.threads,
        rounds=args.rounds or base.rounds,
    )
    impls = [i.strip() for i in args.impls.split(",") if i.strip() and not (args.no_compile and i.strip() == "compile")]
    spec = args.workloads or DEFAULT_WORKLOADS["cuda" if device.type == "cuda" else "cpu"]
    return BenchConfig(
        device=device,
        workloads=parse_workloads(spec, args.scale),
        operations=parse_operations(args.ops),
        impls=impls,
        timing=timing,
        copy_bytes=args.copy_mib << 20 if args.copy_mib else None,
        huge_peers=args.huge_peers,
        compile_max_tensors=args.compile_max_tensors,
        seed=args.seed,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"compare.py: {exc}", file=sys.stderr)
        return 2
    results = run(config, log=lambda line: print(line, flush=True))
    paths = write(results, args.out_dir, with_plot=not args.no_plot)
    print()
    print(markdown(results))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
