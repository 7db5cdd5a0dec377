"""The table, the loss-curve plot and the result files of benchmarks/convergence.py."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
from pathlib import Path

from optimizer_contenders import FP32_STATES, TORCHAO_EAGER, versions

ROOT = Path(__file__).resolve().parent.parent


def final_losses(row: dict) -> list[float]:
    """The last held-out loss of each seed's run."""
    return [run["curve"][-1][1] for run in row.get("runs", [])]


def gap(loss: float, reference: float | None) -> str:
    """Relative gap in percent (positive: worse than the reference), or "–" without a reference."""
    return "–" if reference is None else f"{100 * (loss - reference) / reference:+.2f}%"


def seed_gaps(row: dict, reference: dict | None) -> str:
    """The range of the per-seed gaps to the reference's run with the same seed (the same weights and data):
    paired, so it shows whether a gap of the means holds seed by seed, which the seeds' own spread hides."""
    if reference is None:
        return "–"
    ref = {run["seed"]: run["curve"][-1][1] for run in reference["runs"]}
    gaps = [(run["curve"][-1][1] - ref[run["seed"]]) / ref[run["seed"]] for run in row["runs"] if run["seed"] in ref]
    return f"{100 * min(gaps):+.2f}% – {100 * max(gaps):+.2f}%" if gaps else "–"


def table(rows: list[dict]) -> list[str]:
    """Final held-out loss per contender (mean and spread over seeds), and its gaps to issue 30's references."""
    ran = {r["contender"]: r for r in rows if r.get("runs")}
    means = {name: statistics.mean(final_losses(r)) for name, r in ran.items()}
    lines = [
        "| optimizer | final held-out loss, mean over seeds | seeds (min – max) | vs FusedAdamW fp32 states | "
        "per seed vs fp32 states (min – max) | vs torchao AdamW8bit eager | s / step (one run) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if not r.get("runs"):
            lines.append(f"| {r['contender']} | {r.get('skipped') or 'failed: ' + r['failed']} ||||||")
            continue
        losses, mean = final_losses(r), means[r["contender"]]
        seconds = statistics.mean(run["seconds"] / len(run["train"]) for run in r["runs"])
        lines.append(
            f"| {r['contender']} | {mean:.4f} | {min(losses):.4f} – {max(losses):.4f} | "
            f"{gap(mean, means.get(FP32_STATES))} | {seed_gaps(r, ran.get(FP32_STATES))} | "
            f"{gap(mean, means.get(TORCHAO_EAGER))} | {seconds:.3f} |"
        )
    return lines


def plot(rows: list[dict], floor: float, path: Path) -> None:
    """Held-out loss against optimizer steps, the mean over seeds per contender, with the corpus' floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (full, tail) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in rows:
        if not r.get("runs"):
            continue
        steps = [step for step, _ in r["runs"][0]["curve"]]
        mean = [statistics.mean(run["curve"][i][1] for run in r["runs"]) for i in range(len(steps))]
        for ax, start in ((full, 0), (tail, len(steps) // 2)):
            ax.plot(steps[start:], mean[start:], marker=".", label=r["contender"])
    for ax, title in ((full, "held-out loss"), (tail, "second half, zoomed")):
        ax.axhline(floor, color="grey", linestyle="--", linewidth=1, label="the chain's own loss (floor)")
        ax.set(xlabel="optimizer step", ylabel="loss (nats), mean over seeds", title=title)
        ax.grid(alpha=0.3)
    full.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def head_commit() -> str:
    """The tree's commit, read when a run starts (a run takes minutes; the branch may move meanwhile)."""
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=8", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip()


def write(rows: list[dict], floor: float, args: argparse.Namespace, commit: str) -> None:
    now = datetime.datetime.now(datetime.timezone.utc)
    out = Path(args.out_dir) if args.out_dir else ROOT / "benchmarks" / "results"
    stem = out / f"{now:%Y%m%d-%H%M%S}_convergence_cpu_{commit}"
    found = ", ".join(f"{k} {v}" for k, v in versions().items())
    lines = [
        f"Convergence, cpu ({args.threads} thread), {now:%Y-%m-%d %H:%M} UTC, commit {commit}, {found}, "
        f"load average {os.getloadavg()[0]:.1f} at the end. TinyCausalLM (d_model {args.d_model}, {args.layers} "
        f"layers, {args.heads} heads, {args.param_dtype} params) on an order-2 Markov language (vocab {args.vocab}), "
        f"{args.steps} optimizer steps of {args.accumulation} x {args.micro_batch} sequences of {args.seq_len} "
        f"tokens through GradientAccumulator (fp32 buffers), lr {args.lr} constant, seeds {args.seeds}. Held-out "
        f"loss on {args.eval_sequences} fixed sequences; the chain's own loss there (the floor) is {floor:.4f}. "
        "Gaps: (loss - reference) / reference; issue 30's targets for int8 states: within 1% of fp32 states, and "
        "within 1% of torchao's or below. Times are wall clock on a shared machine: indicative only.",
        "",
        *table(rows),
        "",
        f"Loss curves: {stem.name}.png, beside this file.",
    ]
    stem.with_suffix(".json").write_text(json.dumps({"args": vars(args), "versions": versions(), "floor": floor,
                                                     "rows": rows}))  # fmt: skip
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(rows, floor, stem.with_suffix(".png"))
    print("\n".join(lines))
    print(f"wrote {stem}.md, .json and .png")
