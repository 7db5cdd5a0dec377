"""Runs the grid workload x operation x implementation in one process and one run."""

from __future__ import annotations

import datetime
import gc
import os
import platform
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import ops
from .impls import IMPLS, build_impl
from .operations import OPERATIONS, Operation
from .state import GradState, make_state, needs_params
from .timing import (
    CACHE_MULTIPLE,
    Roofline,
    TimingConfig,
    count_launches,
    host_sync_check,
    measure_interleaved,
    peak_extra_bytes,
    rotating,
    rotation_bytes,
    sets_needed,
    summarize,
    synchronize,
)
from .verify import RTOL, output_error
from .workloads import Workload

Log = Callable[[str], None]


@dataclass
class BenchConfig:
    device: torch.device
    workloads: Sequence[Workload]
    operations: Sequence[Operation] = tuple(OPERATIONS.values())
    impls: Sequence[str] = IMPLS
    timing: TimingConfig = field(default_factory=TimingConfig)
    copy_bytes: int | None = None  # size of the roofline's streams; default: timing.rotation_bytes
    cache_multiple: int = CACHE_MULTIPLE  # a cell's input sets move >= this x the last-level cache together
    count_launches: bool = True  # the profiler run per timed row (seconds on a 2,000-tensor reference)
    huge_peers: bool = False  # run eager/compile on tensors > 2**31 elements (torch #169930 may crash)
    # torch.compile of a 2,000-tensor list ran > 4 min for one op on 2 CPU cores without finishing: such
    # cells are skipped (and reported as skipped) unless this is raised.
    compile_max_tensors: int = 1000
    seed: int = 0

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        bad = [i for i in self.impls if i not in IMPLS]
        if bad or not self.impls:
            raise ValueError(f"impls must be a non-empty subset of {IMPLS}, got {list(self.impls)}")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was requested but torch.cuda.is_available() is False")


# What decides the numbers: a change here that is not committed marks the commit "-dirty".
MEASURED_PATHS = (
    "gradacc_ext/benchmarking", "gradacc_ext/ops", "gradacc_ext/accumulate", "gradacc_ext/__init__.py", "csrc",
    "setup.py", "benchmarks/compare.py",
)  # fmt: skip


def _git_commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--", *MEASURED_PATHS],
            cwd=root, capture_output=True, text=True, check=True, timeout=10,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("-dirty" if changed else "")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model} ({torch.get_num_threads()} threads)"


def environment(device: torch.device) -> dict[str, object]:
    backend, reason = ops.resolve_backend(device, "auto")
    return {
        "device": device.type,
        "device_name": device_name(device),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),  # other work on the machine skews CPU timings
        "gradacc_backend": backend,
        "gradacc_backend_reason": reason,
    }


def _first_call(impl: Callable[[GradState], object], state: GradState, device: torch.device):
    t0 = time.perf_counter()
    out = impl(state)
    synchronize(device)
    return out, time.perf_counter() - t0


def verify_impls(
    impls: dict[str, Callable], op: Operation, state: GradState, device: torch.device
) -> dict[str, dict[str, float]]:
    """Runs every implementation once from the same inputs and compares it with the reference.

    Returns, per implementation, the error and the first call's seconds (for
    torch.compile that is the compile time).
    """
    oracle = impls.get("reference") or build_impl("reference", op)
    state.snapshot()
    out, _ = _first_call(oracle, state, device)
    expected = state.outputs(out)
    report = {}
    for name, impl in impls.items():
        state.restore()
        out, seconds = _first_call(impl, state, device)
        report[name] = {"error": output_error(expected, state.outputs(out)), "first_call_s": seconds}
    state.restore()
    state.drop_snapshot()
    return report


def _skip_reason(name: str, workload: Workload, config: BenchConfig) -> str | None:
    if workload.gpu_only and name in ("eager", "compile") and not config.huge_peers:
        return "skipped: torch foreach ops above 2**31 elements (#169930); --huge-peers runs them"
    if name == "compile" and workload.num_tensors > config.compile_max_tensors:
        return f"skipped: compile of > {config.compile_max_tensors} tensors (--compile-max-tensors raises it)"
    return None


def run_cell(workload: Workload, op: Operation, config: BenchConfig, log: Log) -> list[dict]:
    """Verifies each implementation of one cell, then times them in turns; "% of roofline" is added by run()."""
    device = config.device
    bytes_moved = op.bytes_moved(workload.numel)
    n_sets = sets_needed(bytes_moved, device, config.cache_multiple)
    if workload.gpu_only and op.needs_optimizer:
        # AdamW states of a 2**31-element tensor plus the check's copies would not fit beside the reference.
        log(f"  {workload.name:11s} {op.key:10s} skipped (memory)")
        status = "skipped: AdamW on the > 2**31-element tensor does not fit with the correctness check"
        return [{"workload": workload.name, "op": op.key, "impl": n, "status": status} for n in config.impls]
    names = [n for n in config.impls if _skip_reason(n, workload, config) is None]
    with_params = needs_params(op, tuple(names))  # params only when an implementation reads them
    states = [make_state(workload, op, device, config.seed + k, with_params) for k in range(n_sets)]
    if "compile" in names:
        torch._dynamo.reset()  # fresh caches per cell: never hit the recompile limit and fall back to eager
    impls = {n: build_impl(n, op) for n in names}
    checks = verify_impls(impls, op, states[0], device)

    rows = {}
    for name in config.impls:
        row = {"workload": workload.name, "op": op.key, "impl": name, "bytes": bytes_moved, "n_sets": n_sets}
        rows[name] = row
        row["status"] = _skip_reason(name, workload, config) or "ok"
        if name not in checks:
            continue
        row["max_rel_error"] = checks[name]["error"]
        row["first_call_s"] = checks[name]["first_call_s"]
        if checks[name]["error"] > RTOL:  # never time an implementation that computes something else
            row["status"] = f"MISMATCH: rel. error {checks[name]['error']:.3g} > {RTOL:g}; not timed"
            log(f"  {workload.name:11s} {op.key:10s} {name:9s} {row['status']}")
    timed = [n for n in checks if checks[n]["error"] <= RTOL]
    turns = measure_interleaved({n: rotating(impls[n], states) for n in timed}, config.timing)
    for name in timed:
        row = rows[name]
        row.update(summarize(turns[name]))
        row["gbps"] = bytes_moved / row["median_s"] / 1e9
        if config.count_launches:
            row["launches"], row["launch_unit"] = count_launches(lambda f=impls[name]: f(states[0]), device)
        row["host_sync"] = host_sync_check(lambda f=impls[name]: f(states[0]), device)
        row["peak_extra_bytes"] = peak_extra_bytes(lambda f=impls[name]: f(states[0]), device)
        log(
            f"  {workload.name:11s} {op.key:10s} {name:9s} {row['median_s'] * 1e3:10.3f} ms "
            f"±{100 * row['spread']:4.1f}% {row['gbps']:8.2f} GB/s  first call {row['first_call_s']:.2f} s"
        )
    states.clear()  # free the cell's memory before the next one
    impls.clear()
    if "compile" in names:
        gc.collect()  # compiled graphs hold reference cycles; otherwise reference counts free it all (gc: ~1 s)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return list(rows.values())


def run(config: BenchConfig, log: Log = print) -> dict:
    previous = torch.get_num_threads()
    torch.set_num_threads(config.timing.threads or previous)  # verification and first calls too, not only timing
    try:
        return _run(config, log)
    finally:
        torch.set_num_threads(previous)


def _run(config: BenchConfig, log: Log) -> dict:
    device = config.device
    meta = environment(device)
    log(f"device {meta['device_name']}, torch {meta['torch_version']}, gradacc backend: {meta['gradacc_backend']}")
    rotation = rotation_bytes(device, config.cache_multiple)
    roofline = Roofline(device, config.copy_bytes or rotation, config.timing.threads)
    first = roofline.sample()
    log(f"streams at the start: copy_ {first['copy_gbps']:.2f} GB/s, in-place add_ {first['inplace_gbps']:.2f} GB/s")
    workloads = [w for w in config.workloads if not (w.gpu_only and device.type != "cuda")]
    skipped = [w.name for w in config.workloads if w not in workloads]
    if skipped:
        log(f"skipping GPU-only workloads on {device.type}: {skipped}")
    cells: list[dict] = []
    t0 = time.perf_counter()
    for w in workloads:
        log(f"{w.name}: {w.summary()}")
        for op in config.operations:
            cells += run_cell(w, op, config, log)
            roofline.sample()  # next to every cell: the machine's load changes during the run
    log(f"roofline: {roofline.gbps:.2f} GB/s, the fastest of {len(roofline.samples)} samples")
    roofline_summary = {
        "bytes": 4 * roofline.numel,
        "gbps": roofline.gbps,
        "samples": roofline.samples,
        "rotation_bytes": rotation,
        "cache_multiple": config.cache_multiple,
    }
    for cell in cells:
        if "gbps" in cell:
            cell["pct_copy"] = roofline.percent(cell["gbps"])  # None above it: kept in the JSON as gbps
    meta["run_s"] = time.perf_counter() - t0
    meta["load_average_end"] = os.getloadavg()
    return {
        "meta": meta,
        "timing": vars(config.timing),
        "copy": roofline_summary,
        "workloads": [
            {
                "name": w.name,
                "description": w.description,
                "scale": w.scale,
                "tensors": w.num_tensors,
                "numel": w.numel,
            }  # fmt: skip
            for w in workloads
        ],
        "skipped_workloads": skipped,
        "operations": {
            op.key: {"title": op.title, "bytes_per_element": op.bytes_per_element(), "ours": op.ours}
            for op in config.operations
        },
        "cells": cells,
    }
