"""Issue 10's GPU targets for benchmarks/fused_step.py, and its JSON record (read by scripts/gpu_verify_report.py).

On a GPU, the fused step (accumulate_final_ + adamw_step_ with the clip folded in) must run >= 1.5x the
strongest torch baseline, torch's fused AdamW after the foreach tail, and reach >= 85% of the roofline
(the harness's copy bandwidth) on the 38 B/param floor.
"""

from __future__ import annotations

import json
from pathlib import Path

OURS, PEER = "gradacc accumulate_final_ + adamw_step_", "torch fused AdamW + foreach clip"
MIN_SPEEDUP, MIN_PCT_COPY = 1.5, 85.0


def _target(name: str, measured: float | None, required: float, unit: str) -> dict:
    if measured is None:
        status, text = "n/a (not measured, or above the roofline: rerun)", "-"
    else:
        status, text = ("met" if measured >= required else "not met"), f"{measured:.2f}{unit}"
    return {"target": name, "measured": measured, "required": required, "unit": unit, "status": status,
            "measured_text": text, "required_text": f">= {required:g}{unit}"}  # fmt: skip


def gpu_targets(ms: dict[str, float], pct_copy: dict[str, float | None]) -> list[dict]:
    """The two targets from the run's median ms and % of the roofline per contender."""
    speedup = ms[PEER] / ms[OURS] if OURS in ms and PEER in ms else None
    return [
        _target(f"{OURS}: speedup vs {PEER}", speedup, MIN_SPEEDUP, "x"),
        _target(f"{OURS}: % of copy bandwidth (38 B/param)", pct_copy.get(OURS), MIN_PCT_COPY, "%"),
    ]


def write_json(
    path: Path,
    title: str,
    ms: dict[str, float],
    pct_copy: dict[str, float | None],
    peak_bytes: dict[str, int],
    roofline_gbps: float,
    targets: list[dict],
    floor_bytes: int | None = None,
) -> None:
    """floor_bytes: the 38 B/param floor of one step (scripts/gpu_verify_model.py's model check reads it)."""
    rows = [{"contender": name, "ms": ms[name], "pct_copy": pct_copy[name], "peak_bytes": peak_bytes[name]}
            for name in ms]  # fmt: skip
    record = {"title": title, "roofline_gbps": roofline_gbps, "floor_bytes": floor_bytes, "rows": rows,
              "targets": targets}  # fmt: skip
    path.write_text(json.dumps(record, indent=2) + "\n")
