"""The model check of a scripts/gpu_verify.sh run: each measured headline figure beside its prediction.

The predictions are the newest committed benchmarks/results/*_kernel_report.json (scripts/kernel_report.py
--out; docs/kernel-report.md): per headline figure, its byte-model bytes, the efficiency the kernel report
supports, and the predicted ms on an H100 and an H200. The measured figures are the run's records in
WORK/results: compare.py's gradacc cells (bytes and median per call, the run's copy bandwidth) and
benchmarks/fused_step.py's "gradacc fused step" rows (floor bytes, median ms, the run's roofline).

Each row gives: the prediction for this GPU (the datasheet copy figure), the model recomputed with this
run's measured copy bandwidth (which tests the efficiency alone), and the measured ms. A GPU the
predictions do not model gets the second figure only. Torch-free: it runs after a failed build too.
"""

from __future__ import annotations

import json
from pathlib import Path

from kernel_predictions import FUSED_STEP, gpu_of, predict_ms

ROOT = Path(__file__).resolve().parent.parent
REPORTS = "benchmarks/results/*_kernel_report.json"
FUSED_CONTENDER = "gradacc fused step"


def latest_predictions(root: Path = ROOT) -> dict | None:
    found = sorted(root.glob(REPORTS))
    return json.loads(found[-1].read_text()) | {"file": found[-1].name} if found else None


def figure(key: str, workload: str, nbytes: int, ms: float, copy_gbps: float | None) -> dict:
    return {"key": key, "workload": workload, "bytes": nbytes, "ms": ms, "copy_gbps": copy_gbps}


def measured_figures(work: Path) -> list[dict]:
    """(key, workload, bytes, measured ms, the run's copy GB/s) of every headline-kind record in WORK/results."""
    rows = []
    for f in sorted((work / "results").rglob("*.json")):
        record = json.loads(f.read_text())
        if "cells" in record and "copy" in record:  # compare.py
            copy = record["copy"].get("gbps")
            cells = [c for c in record["cells"] if c["impl"] == "gradacc" and "median_s" in c]
            rows += [figure(c["op"], c["workload"], c["bytes"], 1e3 * c["median_s"], copy) for c in cells]
        elif "roofline_gbps" in record and record.get("floor_bytes"):  # fused_step.py
            ms = {r["contender"]: r["ms"] for r in record["rows"]}
            if FUSED_CONTENDER in ms:
                workload = record["title"].split(":")[0]
                rows.append(
                    figure(FUSED_STEP, workload, record["floor_bytes"], ms[FUSED_CONTENDER], record["roofline_gbps"])
                )
    return rows


def model_check(work: Path, device_name: str, root: Path = ROOT) -> dict:
    """The rows of the summary's model check, and where the predictions came from."""
    predictions = latest_predictions(root)
    if predictions is None:
        return {"source": None, "rows": []}
    by_figure = {(p["key"], p["workload"]): p for p in predictions["predictions"]}
    gpu = gpu_of(device_name)
    rows = []
    for m in measured_figures(work):
        p = by_figure.get((m["key"], m["workload"]))
        if p is None:
            continue
        row = {**m, "efficiency": p["efficiency"], "lower_bound": p["lower_bound"], "gpu": gpu.key if gpu else None}
        # the committed prediction, at the bytes this run moved (its scale may differ from the report's)
        row["predicted_ms"] = predict_ms(m["bytes"], gpu.copy_gbps, p["efficiency"]) if gpu else None
        row["model_ms_at_run_copy"] = (
            predict_ms(m["bytes"], m["copy_gbps"], p["efficiency"]) if m["copy_gbps"] else None
        )
        row["measured_over_predicted"] = m["ms"] / row["predicted_ms"] if row["predicted_ms"] else None
        rows.append(row)
    return {"source": predictions["file"], "rows": rows}


def _ms(x: float | None, lower_bound: bool = False) -> str:
    return "-" if x is None else f"{'>= ' if lower_bound else ''}{x:.3f}"


def markdown(check: dict) -> list[str]:
    if not check["rows"]:
        return []
    lines = ["", f"Model check (predictions: benchmarks/results/{check['source']}; docs/kernel-report.md):", "",
             "| figure | workload | MB moved | predicted ms | model ms at this run's copy (GB/s) | measured ms | "
             "measured / predicted |", "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in check["rows"]:
        ratio = "-" if r["measured_over_predicted"] is None else f"{r['measured_over_predicted']:.2f}"
        copy = f"{r['copy_gbps']:.0f}" if r["copy_gbps"] else "-"
        lines.append(
            f"| {r['key']} | {r['workload']} | {r['bytes'] / 1e6:,.1f} | {_ms(r['predicted_ms'], r['lower_bound'])} "
            f"({r['gpu'] or 'GPU not modelled'}) | {_ms(r['model_ms_at_run_copy'], r['lower_bound'])} ({copy}) | "
            f"{r['ms']:.3f} | {ratio} |"
        )
    return lines
