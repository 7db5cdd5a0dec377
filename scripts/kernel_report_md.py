"""The Markdown of scripts/kernel_report.py: the kernel table, the architecture limits, the predictions."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from kernel_occupancy import ARCHS, max_registers_for
from kernel_predictions import (
    COPY_FRACTION,
    EFFICIENCY,
    FUSED_STEP,
    GPUS,
    HEADLINES,
    REDUCED_EFFICIENCY,
    Headline,
    predict_ms,
)

if TYPE_CHECKING:
    from kernel_report import Kernel

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip() or "?"


def _nvcc_version() -> str:
    out = subprocess.run(
        ["bash", "-c", "${NVCC:-nvcc} --version | tail -n 2 | head -n 1"], capture_output=True, text=True
    )
    return out.stdout.strip() or "?"


def _hot_loops(k: Kernel) -> str:
    """Each hot loop's scalar accesses, `+N x 64-bit` where it holds 64-bit ones, grouped: `6 x 0`."""
    if not k.sass.hot_loops:
        return "—"
    each = [
        f"{s}" + (f" (+{h} x 64-bit)" if h else "")
        for s, h in zip(k.sass.hot_loop_scalar, k.sass.hot_loop_64, strict=True)
    ]
    return ", ".join(f"{each.count(v)} x {v}" for v in dict.fromkeys(each))


def kernel_rows(kernels: list[Kernel], block: int) -> list[str]:
    rows = [
        "| kernel | arch | regs | spill st/ld B | stack B | smem B | blocks x threads / SM (occupancy, limit) "
        "| in flight KB / SM | 128-bit ld / st | scalar ld / st | hot loops: scalar accesses in each | LDL/STL "
        "| verdict |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---|---:|---|",
    ]
    for k in kernels:
        hot = _hot_loops(k)
        verdict = "ok" if not k.problems else "**FAIL**: " + "; ".join(k.problems)
        rows.append(
            f"| `{k.name}` | {k.arch} | {k.res.registers} | {k.res.spill_stores}/{k.res.spill_loads} | "
            f"{k.res.stack_frame} | {k.res.static_smem} | {k.occ.blocks} x {block} ({k.occ.percent:.0f}%, "
            f"{k.occ.limiter}) | {k.in_flight // 1024 if k.sass.hot_loops else '—'} | "
            f"{k.sass.loads_128} / {k.sass.stores_128} | {k.sass.scalar_loads} / "
            f"{k.sass.scalar_stores} | {hot} | {k.sass.local_ops} | {verdict} |"
        )
    return rows


def arch_rows(block: int) -> list[str]:
    rows = [
        "| arch | GPUs | threads / SM | blocks / SM | registers / SM (unit / warp) | shared memory / SM "
        f"(reserved / block) | most registers for 4 / 3 / 2 blocks of {block} |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for a in ARCHS.values():
        regs = " / ".join(str(max_registers_for(a, b, block)) for b in (4, 3, 2))
        rows.append(
            f"| {a.arch} | {a.gpus} | {a.max_threads_per_sm} | {a.max_blocks_per_sm} | {a.registers_per_sm} "
            f"({a.register_unit_per_warp}) | {a.smem_per_sm // 1024} KB ({a.smem_reserved_per_block} B) | {regs} |"
        )
    return rows


def headline_bytes(h: Headline) -> int:
    """The byte model of one headline figure (imports torch: the committed report only)."""
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    from step_probes import FLOOR_BYTES_PER_PARAM

    from gradacc_ext.benchmarking.operations import OPERATIONS
    from gradacc_ext.benchmarking.workloads import make_workload

    numel = make_workload(h.workload, h.scale).numel
    return FLOOR_BYTES_PER_PARAM * numel if h.key == FUSED_STEP else OPERATIONS[h.key].bytes_moved(numel)


def copy_like(kernels: list[Kernel], name: str, arch: str) -> bool:
    """The kernel `name` on `arch` passes the rules and its hot loops hold no scalar access."""
    chosen = [k for k in kernels if k.arch == arch and k.name == name]
    return bool(chosen) and all(not k.problems and k.sass.hot_loops and not any(k.sass.hot_loop_scalar) for k in chosen)


def predictions(kernels: list[Kernel]) -> list[dict]:
    """The predicted ms of every headline figure on every modelled GPU, with its inputs."""
    out = []
    for h in HEADLINES:
        nbytes = headline_bytes(h)
        like = all(copy_like(kernels, name, "sm_90") for name in h.kernels)
        eff = EFFICIENCY if like else REDUCED_EFFICIENCY
        out.append({"key": h.key, "workload": h.workload, "scale": h.scale, "kernels": list(h.kernels),
                    "bytes": nbytes, "copy_like": like, "efficiency": eff, "lower_bound": h.lower_bound,
                    "predicted_ms": {g.key: predict_ms(nbytes, g.copy_gbps, eff) for g in GPUS}})  # fmt: skip
    return out


def prediction_rows(preds: list[dict]) -> list[str]:
    rows = [
        "| figure | workload | bytes moved | streaming kernels (copy-like on sm_90) | efficiency | "
        + " | ".join(f"{g.key} predicted ms" for g in GPUS)
        + " |",
        "|---|---|---:|---|---:|" + "---:|" * len(GPUS),
    ]
    for p in preds:
        bound = ">= " if p["lower_bound"] else ""
        ms = " | ".join(f"{bound}{p['predicted_ms'][g.key]:.3f}" for g in GPUS)
        name = "fused step (accumulate_final_ + adamw_step_)" if p["key"] == FUSED_STEP else f"compare.py `{p['key']}`"
        kernels = ", ".join(f"`{k}`" for k in p["kernels"]) + f" ({'yes' if p['copy_like'] else 'no'})"
        rows.append(f"| {name} | {p['workload']} x{p['scale']:g} | {p['bytes'] / 1e6:,.1f} MB | {kernels} | "
                    f"{p['efficiency']:.2f} | {ms} |")  # fmt: skip
    return rows


def predictions_json(preds: list[dict]) -> dict:
    """What scripts/gpu_verify_model.py reads: the predictions and every input of them."""
    return {"commit": _git("rev-parse", "--short", "HEAD"), "copy_fraction": COPY_FRACTION,
            "gpus": [{"key": g.key, "name": g.name, "peak_gbps": g.peak_gbps, "copy_gbps": g.copy_gbps,
                      "source": g.source} for g in GPUS], "predictions": preds}  # fmt: skip


def render(kernels: list[Kernel], block: int, rules: str, *, tool_version: str,
           preds: list[dict] | None) -> str:  # fmt: skip
    bad = sum(bool(k.problems) for k in kernels)
    dirty = " (with uncommitted changes)" if _git("status", "--porcelain", "--untracked-files=no") != "?" else ""
    lines = [
        "**Kernel report: what the SASS shows (compiled, not run on a GPU)**",
        "",
        f"Generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC by `scripts/kernel_report.py` at commit "
        f"{_git('rev-parse', '--short', 'HEAD')}{dirty}; "
        f"{_nvcc_version()}; {tool_version}. Block size of every launch: {block} threads. "
        f"{len(kernels)} kernel instantiations x arch; {bad} break a rule.",
        "",
        f"Rules (`--check`, CI): {rules}. *Scalar ld / st*: global accesses narrower than 128 bits anywhere in the "
        "kernel (the unaligned and fp64 paths, the tail, the prologue). *Hot loops*: the innermost loops holding "
        "a 128-bit access, one per dtype pair the kernel dispatches on (and per unrolled copy), and the scalar "
        "global accesses inside each. *In flight*: resident threads x the bytes one iteration of the poorest hot "
        "loop loads, per SM.",
        "",
        *kernel_rows(kernels, block),
        "",
        "**Architecture limits** (scripts/kernel_occupancy.py)",
        "",
        "Source: CUDA C++ Programming Guide, *Technical Specifications per Compute Capability*; granularities as "
        "the CUDA Occupancy Calculator applies them.",
        "",
        *arch_rows(block),
    ]
    if preds is not None:
        lines += [
            "",
            "**Predicted device time** (a prediction: no GPU has run these kernels)",
            "",
            f"predicted ms = bytes moved / (datasheet peak x {COPY_FRACTION:.2f} assumed sustained copy x "
            f"efficiency). Efficiency {EFFICIENCY:.2f} when every streaming kernel the figure launches is copy-like "
            f"on sm_90 in the table above (rules met, no scalar access in its hot loops), else "
            f"{REDUCED_EFFICIENCY:.2f}. `>=`: launch-bound (2,000 tensors of <= 4,096 elements), the byte model is a "
            "floor. Inputs: "
            + "; ".join(f"{g.key}: {g.source}, sustained copy {g.copy_gbps:,.0f} GB/s" for g in GPUS)
            + ". `scripts/gpu_verify.sh` writes the measured figure beside each (its summary's model check).",
            "",
            *prediction_rows(preds),
        ]
    return "\n".join(lines) + "\n"
