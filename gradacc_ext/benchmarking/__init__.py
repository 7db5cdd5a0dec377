"""Benchmark harness of gradacc_ext.

Runs every cell (workload x operation x implementation) side by side in one
process: gradacc's fused ops, torch eager, torch.compile of the same eager
code and gradacc's pure-PyTorch reference. Each cell is first checked to
compute the same result as the reference, then timed (torch.utils.benchmark.Timer,
medians, rotated input sets), and reported with GB/s from a
byte model, percent of the copy bandwidth measured in the same run, launch
counts and host-sync checks. benchmarks/compare.py is the full command line;
`gradacc bench` prints cli_table().
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .impls import IMPL_TITLES, IMPLS
from .operations import OPERATIONS, Operation, parse_operations
from .report import markdown, write
from .runner import BenchConfig, Log, run
from .targets import evaluate
from .timing import TimingConfig
from .workloads import WORKLOADS, Workload, make_workload, parse_workloads

# `gradacc bench`: small enough for < 60 s on 2 busy CPU cores; torch.compile (minutes of compiling on a
# CPU) and the AdamW cell are left to benchmarks/compare.py. --quick keeps the two headline cells.
CLI_WORKLOADS = "gpt2-small=0.125,small-2000=0.25"
CLI_OPERATIONS = {"default": "acc_bf16,acc_fp32,tail,norm,clip", "quick": "acc_bf16,tail"}
CLI_IMPLS = {"default": ("gradacc", "eager", "reference"), "quick": ("gradacc", "eager")}
CLI_TIMING = {
    "default": TimingConfig(threshold=0.05, min_time_s=0.1, max_time_s=0.3),
    "quick": TimingConfig(threshold=0.1, min_time_s=0.05, max_time_s=0.25),
}


# The input sets of a `gradacc bench` cell move 2x the last-level cache together, not compare.py's 8x:
# on a VM that reports a 260 MiB L3, 8x meant 2 GiB of sets per cell (most of 60-74 CPU-s, 4.2 GB RSS).
# Sets moving 2x the cache occupy at least its size (no byte is counted more than twice), so a cyclic
# walk over them finds nothing left in an LRU cache. Timed on that VM at load 4 (gpt2-small=0.125,
# gradacc acc_fp32, 1 thread): 2x, 4x and 8x ran at 1.16, 1.17, 1.19 ms, 1x at 0.90 ms (from cache).
# The roofline streams shrink alike, and a cell faster than every roofline sample is still flagged.
CLI_CACHE_MULTIPLE = 2


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def cli_config(device: str | None = None, *, quick: bool = False, threads: int | None = None) -> BenchConfig:
    """What `gradacc bench` runs: scaled-down workloads, no torch.compile."""
    mode = "quick" if quick else "default"
    return BenchConfig(
        device=torch.device(device or default_device()),
        workloads=parse_workloads(CLI_WORKLOADS),
        operations=parse_operations(CLI_OPERATIONS[mode]),
        impls=CLI_IMPLS[mode],
        timing=replace(CLI_TIMING[mode], threads=threads),
        # The profiler's op count costs more than the timing on a CPU (80,000 events for one reference
        # call): only GPU launches are counted here; benchmarks/compare.py counts both.
        count_launches=torch.device(device or default_device()).type == "cuda" and not quick,
        cache_multiple=CLI_CACHE_MULTIPLE,
    )


def cli_table(
    device: str | None = None, *, quick: bool = False, threads: int | None = None, log: Log = lambda _line: None
) -> str:
    """The markdown table `gradacc bench` prints."""
    results = run(cli_config(device, quick=quick, threads=threads), log=log)
    mode = "quick run: two operations" if quick else "scaled-down workloads"
    return markdown(results, title=f"gradacc bench ({mode}, no torch.compile)")


__all__ = [
    "IMPLS",
    "IMPL_TITLES",
    "OPERATIONS",
    "WORKLOADS",
    "Log",
    "BenchConfig",
    "Operation",
    "TimingConfig",
    "Workload",
    "cli_config",
    "cli_table",
    "default_device",
    "evaluate",
    "make_workload",
    "markdown",
    "parse_operations",
    "parse_workloads",
    "run",
    "write",
]
