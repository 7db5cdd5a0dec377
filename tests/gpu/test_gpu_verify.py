"""scripts/gpu_verify.sh: its --dry-run (the plan validated, the CPU-runnable pieces run) passes on
this machine, records the environment and every step; without a GPU a real run stops at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_verify.sh"
GPU_STEPS = {"env", "build", "tests", "gpu_checks", "memcheck", "racecheck", "bench_step", "bench_step_1.3b", "bench"}
pytestmark = pytest.mark.skipif(
    not SCRIPT.exists(), reason="needs the source tree's scripts/ (CI's wheel run tests a copy of tests/ alone)"
)


def run_script(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("PYTHONPATH", None)  # the script must find the in-place build by itself
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_dry_run_passes_and_records_every_step(tmp_path):
    proc = run_script("--dry-run", "--out", str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    steps = {s["step"]: s for s in summary["steps"]}
    assert summary["ok"] and GPU_STEPS <= set(steps), steps
    assert {s["status"] for s in steps.values()} <= {"ok", "dry-run"}
    for name in ("smoke_cpu", "bench_cpu", "bench_step_cpu", "bench_args"):  # the pieces a CPU can run did run
        assert steps[name]["status"] == "ok" and (tmp_path / f"{name}.log").stat().st_size > 0
    env = summary["environment"]
    for key in ("date", "commit", "torch", "driver", "gpus"):
        assert key in env
    assert env["torch"] == torch.__version__
    assert "TORCH_CUDA_ARCH_LIST=" in proc.stdout  # the plan names the single-arch build
    assert list((tmp_path / "bench").glob("*.json")), "the CPU benchmark wrote its results"
    assert "adamw/sgd: fp32, bf16-master, bf16-stochastic, fp16, fp64" in (tmp_path / "smoke_cpu.log").read_text()
    assert "tests/ops/test_ops_optim.py" in proc.stdout and "fused_step.py" in proc.stdout  # memcheck and bench plans
    assert summary["fused_step_targets"] == []  # the CPU run of the fused-step benchmark has no GPU targets
    assert (tmp_path / "summary.md").read_text().startswith("# gpu_verify: PASSED")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_real_run_without_a_gpu_stops_with_a_clear_message(tmp_path):
    proc = run_script("--out", str(tmp_path), timeout=120)
    assert proc.returncode == 2 and "no CUDA GPU" in proc.stderr and "--dry-run" in proc.stderr


def test_summary_lists_the_fused_step_targets(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from fused_step_targets import gpu_targets, write_json
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    ms = {"gradacc fused step": 2.0, "torch fused AdamW + foreach clip": 2.5}
    targets = gpu_targets(ms, {"gradacc fused step": 90.0, "torch fused AdamW + foreach clip": 70.0})
    write_json(tmp_path / "x_fused_step_cuda_gpt2-small.json", "gpt2-small: 148 tensors", ms,
               dict.fromkeys(ms, 80.0), dict.fromkeys(ms, 0), 3000.0, targets)  # fmt: skip
    (tmp_path / "steps.tsv").write_text("bench_step\tok\t0\t12.0\t45\tbench_step.log\n")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_verify_report.py"), "summary", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "summary.md").read_text()
    speedup = "gradacc fused step: speedup vs torch fused AdamW + foreach clip"
    assert f"| gpt2-small | {speedup} | 1.25x | >= 1.5x | not met |" in md
    assert "| gpt2-small | gradacc fused step: % of copy bandwidth (38 B/param) | 90.00% | >= 85% | met |" in md
    assert [t["status"] for t in json.loads((tmp_path / "summary.json").read_text())["fused_step_targets"]] == [
        "not met",
        "met",
    ]


def test_unknown_argument_is_rejected():
    proc = run_script("--dryrun", timeout=30)
    assert proc.returncode == 2 and "unknown argument '--dryrun'" in proc.stderr
