"""The records of scripts/gpu_verify.sh: the environment (device, driver, torch, commit, date) and
the summary of its steps.

    python scripts/gpu_verify_report.py env OUT        # writes OUT/env.json
    python scripts/gpu_verify_report.py summary OUT    # OUT/steps.tsv + env.json -> summary.{json,md}

The summary also lists issue 10's GPU targets from every OUT/*fused_step*.json that
benchmarks/fused_step.py --json wrote (met / not met; they do not decide the exit status).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=ROOT).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def environment() -> dict[str, object]:
    import torch

    gpus = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        gpus.append({"name": torch.cuda.get_device_name(i), "capability": f"{major}.{minor}"})
    smi = _run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
    commit = _run("git", "rev-parse", "HEAD")
    dirty = bool(_run("git", "status", "--porcelain", "--untracked-files=no"))
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit + ("-dirty" if dirty else "") if commit else "unknown",
        "host": platform.node(),
        "cpu_count": __import__("os").cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "driver": smi.splitlines()[0] if smi else None,
        "nvcc": next((ln for ln in _run("nvcc", "--version").splitlines() if "release" in ln), None),
        "gpus": gpus,
    }


def fused_step_targets(out: Path) -> list[dict[str, object]]:
    """Issue 10's targets of each fused-step benchmark record in OUT (none on a CPU run)."""
    rows = []
    for f in sorted(out.glob("*fused_step*.json")):
        record = json.loads(f.read_text())
        rows += [{"file": f.name, "title": record["title"], **t} for t in record["targets"]]
    return rows


def summary(out: Path) -> dict[str, object]:
    env_file = out / "env.json"
    env = json.loads(env_file.read_text()) if env_file.exists() else {}  # the env step failed: say unknown
    for key in ("date", "commit", "host", "cpu_count", "torch", "torch_cuda", "driver"):
        env.setdefault(key, None)
    env.setdefault("gpus", [])
    steps = []
    for line in (out / "steps.tsv").read_text().splitlines():
        name, status, rc, seconds, limit, log = line.split("\t")
        steps.append({"step": name, "status": status, "rc": int(rc), "seconds": float(seconds),
                      "limit_s": int(limit), "log": log})  # fmt: skip
    ok = all(s["status"] in ("ok", "dry-run") for s in steps)
    targets = fused_step_targets(out)
    result = {"ok": ok, "environment": env, "steps": steps, "fused_step_targets": targets}
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    gpu = ", ".join(f"{g['name']} (compute {g['capability']})" for g in env["gpus"]) or "no GPU"
    lines = [
        f"# gpu_verify: {'PASSED' if ok else 'FAILED'}",
        "",
        f"Device: {gpu}; driver {env['driver'] or '-'}; torch {env['torch']} (CUDA {env['torch_cuda'] or '-'}); "
        f"commit {env['commit']}; date {env['date']}; host {env['host']} ({env['cpu_count']} CPUs).",
        "",
        "| step | status | seconds | limit s | log |",
        "|---|---|---:|---:|---|",
    ]
    lines += [f"| {s['step']} | {s['status']} | {s['seconds']:.1f} | {s['limit_s']} | {s['log']} |" for s in steps]
    if targets:
        lines += ["", "Issue 10 GPU targets (benchmarks/fused_step.py):", "",
                  "| workload | target | measured | required | status |", "|---|---|---:|---:|---|"]  # fmt: skip
        lines += [f"| {t['title'].split(':')[0]} | {t['target']} | {t['measured_text']} | {t['required_text']} | "
                  f"{t['status']} |" for t in targets]  # fmt: skip
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("env", "summary"):
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if argv[0] == "env":
        (out / "env.json").write_text(json.dumps(environment(), indent=2) + "\n")
        return 0
    return 0 if summary(out)["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
