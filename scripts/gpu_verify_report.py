"""The record of a scripts/gpu_verify.sh run: what it puts into --out and prints last.

    python scripts/gpu_verify_report.py WORK OUT

WORK holds the run: steps.tsv (name, status, rc, seconds, limit, note), preflight.json, logs/,
junit/ and results/. Into OUT go exactly three files, whatever happened, each far below 16 MiB:
summary.md, summary.json and gpu_verify_logs.tar.gz (all of WORK; a log over LOG_CAP keeps its head
and tail). Printed to stdout: the tail of every step that did not pass, then the summary table, last,
so that it stays inside the last 12,000 characters a caller may keep. The summary also lists issue
10's GPU targets from every fused-step record in WORK/results (met / not met; not the exit status), and
the model check: each measured headline figure beside its committed prediction (gpu_verify_model.py).
Exit status: 0 when every step passed, else 1.
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

from gpu_verify_model import markdown as model_markdown
from gpu_verify_model import model_check

ARCHIVE = "gpu_verify_logs.tar.gz"
ARCHIVE_MAX = 12 * 2**20  # the three files together stay under 16 MiB with room to spare
LOG_CAPS = (4 * 2**20, 2**20, 128 * 2**10)  # per-file cap of the archive, tighter until it fits
TAIL_CHARS = 1500
PASSING = {"ok", "simulated"}  # "simulated": a dry run's stand-in for what needs a GPU
NEUTRAL = {"unsupported"}  # a sanitizer refused by this device or driver: recorded apart from findings


def read_steps(work: Path) -> list[dict[str, object]]:
    steps = []
    for line in (work / "steps.tsv").read_text().splitlines():
        name, status, rc, seconds, limit, note = line.split("\t")
        steps.append({"step": name, "status": status, "rc": int(rc), "seconds": float(seconds),
                      "limit_s": int(limit), "note": note, "log": f"logs/{name}.log"})  # fmt: skip
    return steps


def fused_step_targets(work: Path) -> list[dict[str, object]]:
    """Issue 10's targets of each fused-step benchmark record (none on a CPU run)."""
    rows = []
    for f in sorted((work / "results").glob("*fused_step*.json")):
        record = json.loads(f.read_text())
        rows += [{"file": f.name, "title": record["title"], **t} for t in record["targets"]]
    return rows


def _capped(data: bytes, cap: int) -> bytes:
    if len(data) <= cap:
        return data
    head, tail = cap // 4, cap - cap // 4
    marker = f"\n[... {len(data) - cap} bytes cut by gpu_verify_report.py ...]\n".encode()
    return data[:head] + marker + data[-tail:]


def write_archive(work: Path, out: Path) -> Path:
    """All of WORK in one .tar.gz under ARCHIVE_MAX, each file capped (head and tail kept) if need be."""
    target = out / ARCHIVE
    for cap in LOG_CAPS:
        with tarfile.open(target, "w:gz") as tar:
            for f in sorted(p for p in work.rglob("*") if p.is_file()):
                data = _capped(f.read_bytes(), cap)
                info = tarfile.TarInfo(f"gpu_verify/{f.relative_to(work).as_posix()}")
                info.size, info.mtime = len(data), int(f.stat().st_mtime)
                tar.addfile(info, io.BytesIO(data))
        if target.stat().st_size <= ARCHIVE_MAX:
            break
    return target


def tails(work: Path, steps: list[dict[str, object]]) -> str:
    """The last TAIL_CHARS characters of the log of every step that did not pass."""
    parts = []
    for s in steps:
        log = work / str(s["log"])
        if s["status"] not in PASSING | NEUTRAL and log.exists():
            text = log.read_text(errors="replace")[-TAIL_CHARS:]
            parts.append(f"----- {s['step']}: {s['status']} (rc {s['rc']}), last {len(text)} characters of its log\n"
                         f"{text.rstrip()}\n")  # fmt: skip
    return "\n".join(parts)


def markdown(result: dict) -> str:
    env, steps, targets = result["environment"], result["steps"], result["fused_step_targets"]
    gpu = "; ".join(f"{g['name']} (compute {g['capability']}, {g['free_gib']} of {g['total_gib']} GiB free)"
                    for g in env.get("gpus", [])) or "no GPU"  # fmt: skip
    lines = [
        f"# gpu_verify{' --dry-run' if result['dry_run'] else ''}: {'PASSED' if result['ok'] else 'FAILED'}",
        "",
        f"Device: {gpu}; driver {env.get('driver') or '-'}; torch {env.get('torch')} (CUDA "
        f"{env.get('torch_cuda') or '-'}); nvcc {env.get('nvcc') or '-'}; sanitizer "
        f"{env.get('compute_sanitizer') or '-'}; commit {env.get('commit')}"
        f"{'; wheel ' + env['wheel'] if env.get('wheel') else ''}; date {env.get('date')}; host "
        f"{env.get('host')} ({env.get('cpu_count')} CPUs). Logs, junit and results: {ARCHIVE}.",
        "",
        "| step | status | seconds | limit s | note |",
        "|---|---|---:|---:|---|",
    ]
    lines += [f"| {s['step']} | {s['status']} | {s['seconds']:.1f} | {s['limit_s']} | {s['note']} |" for s in steps]
    if targets:
        lines += ["", "Issue 10 GPU targets (benchmarks/fused_step.py):", "",
                  "| workload | target | measured | required | status |", "|---|---|---:|---:|---|"]  # fmt: skip
        lines += [f"| {t['title'].split(':')[0]} | {t['target']} | {t['measured_text']} | {t['required_text']} | "
                  f"{t['status']} |" for t in targets]  # fmt: skip
    lines += model_markdown(result["model_check"])
    return "\n".join(lines) + "\n"


def report(work: Path, out: Path, dry_run: bool) -> dict[str, object]:
    """Writes OUT's three files and returns the summary."""
    pre = work / "preflight.json"
    env = json.loads(pre.read_text()) if pre.exists() else {}  # the preflight failed: say unknown
    steps = read_steps(work)
    ok = bool(steps) and all(s["status"] in PASSING | NEUTRAL for s in steps)
    device = next((g["name"] for g in env.get("gpus", [])), "")
    result = {"ok": ok, "dry_run": dry_run, "environment": env, "steps": steps,
              "fused_step_targets": fused_step_targets(work), "model_check": model_check(work, device),
              "archive": ARCHIVE}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "summary.md").write_text(markdown(result))
    write_archive(work, out)
    return result


def main(argv: list[str]) -> int:
    args = [a for a in argv if a != "--dry-run"]
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    work, out = Path(args[0]), Path(args[1])
    result = report(work, out, "--dry-run" in argv)
    text = tails(work, result["steps"])
    size = (out / ARCHIVE).stat().st_size / 2**20
    print(f"{text}\n===== {out}: summary.md, summary.json, {ARCHIVE} ({size:.2f} MiB)\n")
    print((out / "summary.md").read_text(), end="")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
