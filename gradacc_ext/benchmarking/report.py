"""Results as a markdown table, a JSON file and a PNG plot."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from .impls import IMPL_TITLES, OURS
from .targets import evaluate, speedup

OVER_ROOFLINE = "> roofline: load changed, rerun"


def _fmt(value: float | None, spec: str, missing: str = "—") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return format(value, spec)


def _mib(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**20:.1f}"


def file_stem(results: dict) -> str:
    """date_device_torch_commit, e.g. 20260101-120000_cpu_torch2.13.0-cpu_9c684d38."""
    meta = results["meta"]
    date = re.sub(r"[^0-9T]", "", meta["date"]).replace("T", "-")
    device = "cpu" if meta["device"] == "cpu" else re.sub(r"[^a-z0-9]+", "-", meta["device_name"].lower()).strip("-")
    torch_version = re.sub(r"[^0-9a-zA-Z.]+", "-", meta["torch_version"])
    return f"{date}_{device}_torch{torch_version}_{meta['commit'][:8]}"


def header(results: dict) -> list[str]:
    meta, copy, timing = results["meta"], results["copy"], results["timing"]
    cuda = f", CUDA {meta['cuda_version']}" if meta.get("cuda_version") else ""
    load = meta.get("load_average")
    load_text = f", load average at start {load[0]:.1f}" if load else ""
    return [
        f"Device: {meta['device_name']}; torch {meta['torch_version']}{cuda}; commit {meta['commit']}; "
        f"date {meta['date']}{load_text}.",
        f"gradacc backend on this device: {meta['gradacc_backend']} ({meta['gradacc_backend_reason']}).",
        f"Roofline: {copy['gbps']:.2f} GB/s, the fastest call of two fp32 streams over {copy['bytes'] / 2**20:.0f} MiB "
        "(dst.copy_(src) charged 8 B/element, the in-place dst.add_(src) 12 B), sampled at the start and after "
        f"every cell; % copy = a cell's median GB/s / the roofline (\"{OVER_ROOFLINE}\": the cell was timed "
        "in a quieter moment than every sample, so its figure says more about the machine's load than the op).",
        f"Timing: torch.utils.benchmark.Timer.adaptive_autorange (calibrated calls per block; stops when the "
        f"blocks' IQR/median < {timing['threshold']:g} after >= {timing['min_time_s']:g} s, or at "
        f"{timing['max_time_s']:g} s, split over {timing.get('rounds', 1)} turns per implementation, the "
        f"implementations taking turns); {meta['threads']} CPU thread{'s' if meta['threads'] > 1 else ''}; "
        "median per call, ± = IQR/median; GB/s from the byte model (benchmarks/NOTES.md)"
        + _rotation_text(copy)
        + ".",
    ]


def _rotation_text(copy: dict) -> str:
    """Older result files lack the rotation: nothing is said for them."""
    if "rotation_bytes" not in copy:
        return ""
    return (
        f"; every call runs on the next of a cell's input sets, which together move >= "
        f"{copy['rotation_bytes'] / 2**20:.0f} MiB ({copy['cache_multiple']}x the last-level cache, or a floor)"
    )


def workloads_table(results: dict) -> list[str]:
    lines = ["| workload | tensors | elements | scale | description |", "|---|---:|---:|---:|---|"]
    for w in results["workloads"]:
        lines.append(f"| {w['name']} | {w['tensors']:,} | {w['numel']:,} | {w['scale']:g} | {w['description']} |")
    return lines


def results_table(results: dict) -> list[str]:
    cuda = results["meta"]["device"] == "cuda"
    launches = "launches" if cuda else "aten ops"
    lines = [
        f"| workload | operation | implementation | median ms | ± | GB/s | % copy | {launches} | host syncs | "
        "peak extra MiB | first call s | gradacc speedup |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    cells = {(c["workload"], c["op"], c["impl"]): c for c in results["cells"]}
    for c in results["cells"]:
        title = IMPL_TITLES[c["impl"]]
        if "median_s" not in c:
            lines.append(f"| {c['workload']} | {c['op']} | {title} | {c['status']} | | | | | | | | |")
            continue
        ratio = "—" if c["impl"] == OURS else _fmt(speedup(cells, c["workload"], c["op"], c["impl"]), ".2f") + "x"
        lines.append(
            f"| {c['workload']} | {c['op']} | {title} | {c['median_s'] * 1e3:.3f} | {100 * c['spread']:.1f}% | "
            f"{c['gbps']:.2f} | {_fmt(c['pct_copy'], '.1f', OVER_ROOFLINE)} | {c.get('launches', '—')} | "
            f"{c['host_sync']} | {_mib(c.get('peak_extra_bytes'))} | {c['first_call_s']:.2f} | {ratio} |"
        )
    return lines


def targets_table(targets: list[dict]) -> list[str]:
    lines = ["| target | workload | measured | required | status |", "|---|---|---:|---:|---|"]
    for t in targets:
        required = f"{'<=' if t['at_most'] else '>='} {t['required']:g}{t['unit']}"
        measured = _fmt(t["measured"], ".2f") + (t["unit"] if t["measured"] is not None else "")
        lines.append(f"| {t['target']} | {t['workload']} | {measured} | {required} | **{t['status']}** |")
    return lines


def markdown(results: dict, title: str = "gradacc benchmark") -> str:
    device = results["meta"]["device"]
    scope = "GPU targets" if device == "cuda" else "CPU target (GPU targets need a CUDA run)"
    parts = [
        f"# {title}",
        "",
        *header(results),
        "",
        "## Workloads",
        "",
        *workloads_table(results),
        "",
        "## Results",
        "",
        "gradacc speedup = that row's median / gradacc's median (> 1: gradacc is faster). "
        + (
            "launches = device kernels + memcpy/memset in one call (torch.profiler)."
            if device == "cuda"
            else "aten ops = aten/gradacc ops dispatched in one call (torch.profiler, CPU; there are no launches; "
            "code compiled by inductor runs outside the dispatcher and is not counted)."
        ),  # fmt: skip
        "",
        *results_table(results),
        "",
        f"## Targets ({scope})",
        "",
        *targets_table(results.get("targets") or evaluate(results)),
        "",
    ]
    return "\n".join(parts)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w["name"] for w in results["workloads"]]
    ops = list(results["operations"])
    impls = list(dict.fromkeys(c["impl"] for c in results["cells"]))
    cells = {(c["workload"], c["op"], c["impl"]): c for c in results["cells"]}
    fig, axes = plt.subplots(len(workloads), 1, figsize=(12, 3.6 * len(workloads)), squeeze=False)
    width = 0.8 / max(1, len(impls))
    for ax, w in zip(axes[:, 0], workloads, strict=True):
        for k, impl in enumerate(impls):
            values = [cells.get((w, op, impl), {}).get("gbps", 0.0) for op in ops]
            ax.bar([i + k * width for i in range(len(ops))], values, width, label=IMPL_TITLES[impl])
        ax.axhline(
            results["copy"]["gbps"], color="black", linestyle="--", linewidth=1, label="copy bandwidth (run start)"
        )
        ax.set_yscale("log")
        ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(ops))], ops)
        ax.set_ylabel("GB/s (byte model)")
        ax.set_title(w)
        ax.legend(fontsize=7, ncol=len(impls) + 1)
    meta = results["meta"]
    fig.suptitle(f"{meta['device_name']} | torch {meta['torch_version']} | {meta['commit'][:12]} | {meta['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(results: dict, out_dir: Path, with_plot: bool = True) -> list[Path]:
    """Writes <stem>.json, <stem>.md and <stem>.png under out_dir; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results.setdefault("targets", evaluate(results))
    stem = file_stem(results)  # contains dots (torch version): never use Path.with_suffix on it
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    paths[0].write_text(json.dumps(results, indent=1, default=float) + "\n")
    paths[1].write_text(markdown(results))
    if with_plot:
        paths.append(out_dir / f"{stem}.png")
        plot(results, paths[-1])
    return paths
