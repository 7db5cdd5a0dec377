"""Benchmark harness of gradacc_ext.

Runs every cell (workload x operation x implementation) side by side in one
process: gradacc's fused ops, torch eager, torch.compile of the same eager
code and gradacc's pure-PyTorch reference. Each cell is first checked to
compute the same result as the reference, then timed (CUDA events or
perf_counter, medians, rotated input sets), and reported with GB/s from a
byte model, percent of the copy bandwidth measured in the same run, launch
counts and host-sync checks. benchmarks/compare.py is the full command line;
`gradacc bench` prints quick_table().
"""

from __future__ import annotations

import torch

from .impls import IMPL_TITLES, IMPLS
from .operations import OPERATIONS, Operation, parse_operations
from .report import markdown, write
from .runner import BenchConfig, run
from .targets import evaluate
from .timing import TimingConfig
from .workloads import WORKLOADS, Workload, make_workload, parse_workloads

# Small enough for < 30 s on 2 CPU cores; torch.compile (minutes of compiling
# on a CPU) and the AdamW cell are left to benchmarks/compare.py.
QUICK_WORKLOADS = "gpt2-small=0.125,small-2000=0.25"
QUICK_OPERATIONS = "acc_bf16,acc_fp32,tail,norm,clip"
QUICK_IMPLS = ("gradacc", "eager", "reference")
QUICK_TIMING = TimingConfig(warmup=1, min_reps=3, max_reps=3, min_time_s=0.0)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def quick_table(device: str | None = None) -> str:
    """A markdown table of a quick run on this machine (scaled-down workloads, no torch.compile)."""
    config = BenchConfig(
        device=torch.device(device or default_device()),
        workloads=parse_workloads(QUICK_WORKLOADS),
        operations=parse_operations(QUICK_OPERATIONS),
        impls=QUICK_IMPLS,
        timing=QUICK_TIMING,
    )
    results = run(config, log=lambda _line: None)
    return markdown(results, title="gradacc bench (quick run: scaled-down workloads, no torch.compile)")


__all__ = [
    "IMPLS",
    "IMPL_TITLES",
    "OPERATIONS",
    "WORKLOADS",
    "BenchConfig",
    "Operation",
    "TimingConfig",
    "Workload",
    "default_device",
    "evaluate",
    "make_workload",
    "markdown",
    "parse_operations",
    "parse_workloads",
    "quick_table",
    "run",
    "write",
]
