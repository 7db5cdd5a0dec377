"""The issue's performance targets, evaluated on one run's cells.

GPU (same run): accumulate >= 85% of copy bandwidth on the large sets,
>= 3x torch eager mixed-dtype, >= 1.2x torch.compile; final tail >= 2x
eager, >= 1.2x compile, at most 2 launches up to 1,000 tensors, no host
sync. CPU: the fused C++ path >= 1.5x the pure-PyTorch reference.
"""

from __future__ import annotations

from .impls import OURS

MAX_TAIL_LAUNCH_TENSORS = 1000


def _cells(results: dict) -> dict[tuple[str, str, str], dict]:
    return {(c["workload"], c["op"], c["impl"]): c for c in results["cells"]}


def speedup(cells: dict, workload: str, op: str, peer: str) -> float | None:
    """peer median / gradacc median, or None when either was not timed."""
    ours, other = cells.get((workload, op, OURS)), cells.get((workload, op, peer))
    if not ours or not other or "median_s" not in ours or "median_s" not in other:
        return None
    return other["median_s"] / ours["median_s"]


def _target(name: str, workload: str, measured: float | None, required: float, unit: str, at_most: bool = False):
    if measured is None:
        status = "n/a (not run)"
    else:
        status = "met" if (measured <= required if at_most else measured >= required) else "missed"
    return {"target": name, "workload": workload, "measured": measured, "required": required, "unit": unit,
            "at_most": at_most, "status": status}  # fmt: skip


def _gpu_targets(results: dict, cells: dict) -> list[dict]:
    out = []
    for w in results["workloads"]:
        name = w["name"]
        for op in ("acc_bf16", "acc_fp32"):
            if w["name"] in ("gpt2-small", "gpt-1.3b", "huge"):
                cell = cells.get((name, op, OURS), {})
                out.append(_target(f"{op}: % of copy bandwidth", name, cell.get("pct_copy"), 85.0, "%"))
            out.append(_target(f"{op}: speedup vs torch.compile", name, speedup(cells, name, op, "compile"), 1.2, "x"))
        out.append(_target("acc_bf16: speedup vs eager", name, speedup(cells, name, "acc_bf16", "eager"), 3.0, "x"))
        out.append(_target("tail: speedup vs eager", name, speedup(cells, name, "tail", "eager"), 2.0, "x"))
        out.append(_target("tail: speedup vs torch.compile", name, speedup(cells, name, "tail", "compile"), 1.2, "x"))
        tail = cells.get((name, "tail", OURS), {})
        if w["tensors"] <= MAX_TAIL_LAUNCH_TENSORS:
            out.append(_target("tail: device launches", name, tail.get("launches"), 2, "", at_most=True))
        syncs = None if "host_sync" not in tail else float(tail["host_sync"] != "none")
        out.append(_target("tail: host syncs (sync_debug_mode='error')", name, syncs, 0, "", at_most=True))
    return out


def _cpu_targets(results: dict, cells: dict) -> list[dict]:
    out = []
    for w in results["workloads"]:
        for op, spec in results["operations"].items():
            if spec.get("ours", True):
                measured = speedup(cells, w["name"], op, "reference")
                out.append(_target(f"{op}: C++ speedup vs reference", w["name"], measured, 1.5, "x"))
    return out


def evaluate(results: dict) -> list[dict]:
    cells = _cells(results)
    if results["meta"]["device"] == "cuda":
        return _gpu_targets(results, cells)
    return _cpu_targets(results, cells)
