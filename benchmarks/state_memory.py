"""Steady-state bytes per parameter INCLUDING the optimizer state, per optimizer (issue 30's memory table).

    python benchmarks/state_memory.py                    # CPU, the scaled-down GPT-2-shaped model of memory.py
    python benchmarks/state_memory.py --contenders "FusedAdamW fp32 states" "torch AdamW (foreach)"

bf16 params, fp32 accumulation buffers (GradientAccumulationConfig's default accum_dtype), 4 micro-steps a
window, every optimizer of benchmarks/optimizer_contenders.py (FusedAdamW in its stochastic-rounding param
mode, without master weights, unless the row says master). benchmarks/memory.py reports bytes ABOVE model +
optimizer state, so the state's storage does not show there; this script counts it:

* held between windows (after two windows: the state and the buffers exist): every storage the params, the
  accumulator's buffers (and any .grad outside them), the master weights and the rest of the optimizer state
  hold, each storage counted once; tensor subclasses (torchao's quantized states) count their inner tensors.
  Deterministic: live tensors, not the allocator.
* the peak in the third window, measured as memory.py does (its LiveBytes allocator probe over the whole
  window, the closing micro-step's fused tail included), added to the bytes held; it includes activations,
  which are the same for every optimizer.

Writes <date>_state_memory_<device>_<commit>.{json,md} under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from memory import GPT, add_model_args
from memory_probes import LiveBytes
from optimizer_contenders import CONTENDERS, Contender, tensors_of, versions

from gradacc_ext import GradientAccumulationConfig, GradientAccumulator

ROOT = Path(__file__).resolve().parent.parent
STEPS = 4  # micro-steps per window
COLUMNS = ("param", "grad buffer", "master", "optimizer state")
# Issue 30's targets, bytes held per param with bf16 params and fp32 buffers (fp32 states: unchanged at 14).
TARGETS = {"FusedAdamW fp32 states": 14.0, "FusedAdamW bf16 states": 10.1, "FusedAdamW int8 states": 8.1}
# torchao's compiled step holds the same state as its eager one; compiling takes minutes on a CPU.
DEFAULT_CONTENDERS = [name for name in CONTENDERS if name != "torchao AdamW8bit compiled"]


def _storages_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    """Bytes of the storages behind `tensors` not yet in `seen` (data pointers), each storage once."""
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, acc: GradientAccumulator) -> dict[str, int]:
    """Bytes held per COLUMNS entry: params, gradient buffers (the accumulator's flat buffers and any .grad
    outside them), FusedAdamW's master weights, and every other optimizer state tensor (moments, steps, codes,
    scales, maps). Each storage is counted once, in the first column that holds it."""
    params = list(model.parameters())
    seen: set[int] = set()
    grads = list(acc._buffers.flats.values()) + [p.grad for p in params if p.grad is not None]
    states = list(optimizer.state.values())
    return {
        "param": _storages_bytes(params, seen),
        "grad buffer": _storages_bytes(grads, seen),
        "master": _storages_bytes((s["master_param"] for s in states if "master_param" in s), seen),
        "optimizer state": _storages_bytes(tensors_of(states), seen),
    }


def measure(contender: Contender, args: argparse.Namespace) -> dict:
    """Held bytes after two windows, and the third window's peak, for one optimizer on a fresh model."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(args.vocab, args.ctx, args.width, args.layers, args.heads).to(device, torch.bfloat16)
    optimizer = contender.build(list(model.parameters()), 1e-4)
    config = GradientAccumulationConfig(accumulation_steps=STEPS, accum_dtype=torch.float32)
    acc = GradientAccumulator(model, optimizer, config)
    data = torch.randint(0, args.vocab, (3 * STEPS, args.micro_batch, args.ctx + 1), device=device)

    def micro(i: int) -> None:
        logits = model(data[i, :, :-1]).float()
        acc.backward(F.cross_entropy(logits.flatten(0, 1), data[i, :, 1:].flatten()))

    with contender.stepping():
        for i in range(2 * STEPS):
            micro(i)
        held = held_bytes(model, optimizer, acc)
        with LiveBytes(device) as window:
            for i in range(2 * STEPS, 3 * STEPS):
                micro(i)
    if acc.optimizer_steps != 3 or acc.skipped_steps:
        raise RuntimeError(f"expected 3 optimizer steps, none skipped; got {acc.optimizer_steps}, {acc.skipped_steps}")
    n = sum(p.numel() for p in model.parameters())
    return {"contender": contender.name, "params": n, **held, "window_peak": window.peak}


def run(names: list[str], args: argparse.Namespace) -> list[dict]:
    rows = []
    for name in names:
        contender = CONTENDERS[name]
        why = contender.missing()
        if why is None:
            try:
                row = measure(contender, args)
            except Exception as error:  # a peer's CPU path may not work: the row says how it failed
                row = {"contender": name, "failed": f"{type(error).__name__}: {error}"}
        else:
            row = {"contender": name, "skipped": why}
        gc.collect()
        rows.append(row)
        print(row, flush=True)
    return rows


def verdict(name: str, held_per_param: float) -> str:
    """The row's issue 30 target and whether the bytes held (as the table rounds them) meet it; "–" for none."""
    target = TARGETS.get(name)
    if target is None:
        return "–"
    return f"≤ {target:g}: {'met' if round(held_per_param, 2) <= target else 'NOT met'}"


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| optimizer | param | grad buffer | master | optimizer state | held B/param | issue 30 target | "
        "peak in window B/param |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "params" not in r:
            lines.append(f"| {r['contender']} | {r.get('skipped') or 'failed: ' + r['failed']} |||||||")
            continue
        n, held = r["params"], sum(r[c] for c in COLUMNS)
        cells = " | ".join(f"{r[c] / n:.2f}" if r[c] else "–" for c in COLUMNS)
        target = verdict(r["contender"], held / n)
        lines.append(
            f"| {r['contender']} | {cells} | {held / n:.2f} | {target} | {(held + r['window_peak']) / n:.2f} |"
        )
    return lines


def write(rows: list[dict], args: argparse.Namespace) -> None:
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=8", "HEAD"], capture_output=True, text=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    stem = ROOT / "benchmarks" / "results" / f"{now:%Y%m%d-%H%M%S}_state_memory_{args.device}_{commit.stdout.strip()}"
    n = next((r["params"] for r in rows if "params" in r), 0)
    found = ", ".join(f"{k} {v}" for k, v in versions().items())
    lines = [
        f"State-inclusive memory, {args.device}, {now:%Y-%m-%d %H:%M} UTC, commit {commit.stdout.strip()}, {found}, "
        f"load average {os.getloadavg()[0]:.1f}. GPT-2-shaped model: {n:,} bf16 parameters (width {args.width}, "
        f"{args.layers} layers, vocab {args.vocab}, ctx {args.ctx}), micro-batch {args.micro_batch}, {STEPS} "
        "micro-steps a window, fp32 accumulation buffers. Columns: bytes held between windows per parameter (each "
        "storage once; steps, scales and quantization maps are in the optimizer state); the peak in the third "
        "window (memory.py's allocator probe, activations included) is added to the bytes held.",
        "",
        *table(rows),
    ]
    stem.with_suffix(".json").write_text(json.dumps({"args": vars(args), "versions": versions(), "rows": rows}))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {stem}.md and .json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--contenders", nargs="+", choices=list(CONTENDERS), default=DEFAULT_CONTENDERS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    write(run(args.contenders, args), args)


if __name__ == "__main__":
    main()
