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
    out = subprocess.run(["bash", "-c", "${NVCC:-nvcc} --version | tail -n 2 | head -n 1"], capture_output=True, text=True)
    return out.stdout.strip() or "?"


def kernel_rows(kernels: list[Kernel], block: int) -> list[str]:
    rows = [
        "| kernel | arch | regs | spill st/ld B | stack B | smem B | blocks x threads / SM (occupancy, limit) "
        "| 128-bit ld / st | scalar ld / st | hot loops: scalar accesses in each | LDL/STL | verdict |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---|---:|---|",
    ]
    for k in kernels:
        hot = ", ".join(map(str, k.sass.hot_loop_scalar)) if k.sass.hot_loops else "—"
        verdict = "ok" if not k.problems else "**FAIL**: " + "; ".join(k.problems)
        rows.append(
            f"| `{k.name}` | {k.arch} | {k.res.registers} | {k.res.spill_stores}/{k.res.spill_loads} | "
            f"{k.res.stack_frame} | {k.res.static_smem} | {k.occ.blocks} x {block} ({k.occ.percent:.0f}%, "
            f"{k.occ.limiter}) | {k.sass.loads_128} / {k.sass.stores_128} | {k.sass.scalar_loads} / "
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


def copy_like(kernels: list[Kernel], families: tuple[str, ...], arch: str) -> bool:
    """Every streaming kernel of these families on `arch` passes the rules with a scalar-free hot loop."""
    chosen = [k for k in kernels if k.arch == arch and k.name.startswith(families) and k.sass.hot_loops]
    return bool(chosen) and all(not k.problems and not any(k.sass.hot_loop_scalar) for k in chosen)


def prediction_rows(kernels: list[Kernel]) -> list[str]:
    rows = [
        "| figure | workload | bytes moved | kernels copy-like on sm_90 | efficiency | "
        + " | ".join(f"{g.key} predicted ms" for g in GPUS) + " |",
        "|---|---|---:|---|---:|" + "---:|" * len(GPUS),
    ]
    for h in HEADLINES:
        nbytes = headline_bytes(h)
        like = all(copy_like(kernels, (f,), "sm_90") for f in h.kernels)
        eff = EFFICIENCY if like else REDUCED_EFFICIENCY
        bound = ">= " if h.lower_bound else ""
        ms = " | ".join(f"{bound}{predict_ms(nbytes, g.copy_gbps, eff):.3f}" for g in GPUS)
        name = "fused step (accumulate_final_ + adamw_step_)" if h.key == FUSED_STEP else f"compare.py `{h.key}`"
        rows.append(f"| {name} | {h.workload} x{h.scale:g} | {nbytes / 1e6:,.1f} MB | {'yes' if like else 'no'} | "
                    f"{eff:.2f} | {ms} |")  # fmt: skip
    return rows


def render(kernels: list[Kernel], block: int, floor: float, vectorised: dict[str, bool], *, tool_version: str,
           with_predictions: bool) -> str:  # fmt: skip
    bad = sum(bool(k.problems) for k in kernels)
    lines = [
        "# Kernel report: what the SASS shows (compiled, not run on a GPU)",
        "",
        f"Generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC by `scripts/kernel_report.py` at commit "
        f"{_git('rev-parse', '--short', 'HEAD')}{' (uncommitted changes)' if _git('status', '--porcelain') != '?' else ''}; "
        f"{_nvcc_version()}; {tool_version}. Block size of every launch: {block} threads. "
        f"{len(kernels)} kernel instantiations x arch; {bad} break a rule.",
        "",
        "Rules (`--check`, CI): no spill, stack frame or local-memory instruction (LDL/STL); 128-bit global "
        f"loads (and stores where it stores) in every vectorised kernel ({', '.join(f'`{v}`' for v in vectorised)}); "
        f"occupancy >= {floor:.0f}%. *Scalar ld / st*: global accesses narrower than 128 bits anywhere in the "
        "kernel (the unaligned and fp64 paths, the tail, the prologue). *Hot loops*: the innermost loops holding "
        "a 128-bit access, one per dtype pair the kernel dispatches on, and the scalar global accesses inside each.",
        "",
        *kernel_rows(kernels, block),
        "",
        "## Architecture limits (scripts/kernel_occupancy.py)",
        "",
        "Source: CUDA C++ Programming Guide, *Technical Specifications per Compute Capability*; granularities as "
        "the CUDA Occupancy Calculator applies them.",
        "",
        *arch_rows(block),
    ]
    if with_predictions:
        lines += [
            "",
            "## Predicted device time (a prediction: no GPU has run these kernels)",
            "",
            f"predicted ms = bytes moved / (datasheet peak x {COPY_FRACTION:.2f} assumed sustained copy x "
            f"efficiency). Efficiency {EFFICIENCY:.2f} when every streaming kernel the figure launches is copy-like "
            f"on sm_90 in the table above (rules met, no scalar access in its hot loops), else "
            f"{REDUCED_EFFICIENCY:.2f}. `>=`: launch-bound (2,000 tensors of <= 4,096 elements), the byte model is a "
            "floor. Inputs: " + "; ".join(f"{g.key}: {g.source}, sustained copy {g.copy_gbps:,.0f} GB/s" for g in GPUS)
            + ". `scripts/gpu_verify.sh` writes the measured figure beside each (its summary's model check).",
            "",
            *prediction_rows(kernels),
        ]
    return "\n".join(lines) + "\n"
