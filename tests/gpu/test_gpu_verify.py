"""scripts/gpu_verify.sh and its helpers: the rehearsal (--dry-run) obeys the GPU machine's output
contract and keeps a timed-out step's partial junit; the budget, the junit and sanitizer checks, the
archive's size cap and the summary's GPU targets, each on its own."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from _cuda_ids import RUN_BY_PATH

import gradacc_ext

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_verify.sh"
STEPS = ["preflight", "build", "kernels", "smoke", "cuda_tests", "gpu_checks", "gpu_large", "sanitizer_probe",
         "memcheck", "racecheck", "bench_step", "bench_eager", "bench_compile"]  # fmt: skip
SIMULATED = {"build", "sanitizer_probe", "memcheck", "racecheck"}
NAME = re.compile(r"^[A-Za-z0-9._-]+$")
pytestmark = pytest.mark.skipif(
    not SCRIPT.exists(), reason="needs the source tree's scripts/ (CI's wheel run tests a copy of tests/ alone)"
)


def run_script(*args: str, timeout: float, **env: str) -> subprocess.CompletedProcess:
    environ = dict(os.environ, PYTHON=sys.executable, **env)
    environ.pop("PYTHONPATH", None)  # the script must find the in-place build by itself
    if "OUT" not in env:
        environ.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=environ)


def helper(name: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # as gpu_verify.sh runs them: the in-place build first
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *map(str, args)], capture_output=True,
                          text=True, timeout=120, env=env)  # fmt: skip


def assert_output_contract(out: Path, stdout: str) -> None:
    """At most 8 files, each <= 16 MiB, <= 2 folders deep, plain names; the summary table last in stdout,
    within its last 12,000 characters."""
    entries = list(out.rglob("*"))
    files = [p for p in entries if p.is_file()]
    assert sorted(p.name for p in files) == ["gpu_verify_logs.tar.gz", "summary.json", "summary.md"]
    assert len(files) <= 8 and all(p.stat().st_size <= 16 * 2**20 for p in files)
    for p in entries:
        parts = p.relative_to(out).parts
        assert len(parts) <= 3 and all(NAME.match(part) for part in parts), p
    table = (out / "summary.md").read_text()
    assert stdout.endswith(table) and table in stdout[-12_000:]


def test_rehearsal_keeps_the_output_contract_and_a_timed_out_steps_junit(tmp_path):
    """The rehearsal with one stand-in test that hangs: its step is stopped by SIGINT, and the junit of the
    tests that ran before it is in the archive; every other step still runs and passes."""
    hang = tmp_path / "standin" / "test_hangs.py"
    hang.parent.mkdir()
    hang.write_text("import time\n\n\ndef test_cpu_hangs():\n    time.sleep(600)\n")
    out = tmp_path / "out"
    proc = run_script("--dry-run", "--out", str(out), timeout=480, GPU_VERIFY_LIMITS="cuda_tests=45",
                      GPU_VERIFY_REHEARSAL_TESTS=f"tests/ops/test_ops_scale.py {hang}")  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_output_contract(out, proc.stdout)
    summary = json.loads((out / "summary.json").read_text())
    status = {s["step"]: s["status"] for s in summary["steps"]}
    assert list(status) == STEPS and not summary["ok"] and summary["dry_run"]
    assert status.pop("cuda_tests") == "timeout"
    assert status == {name: "simulated" if name in SIMULATED else "ok" for name in status}, status
    md = (out / "summary.md").read_text()
    assert md.startswith("# gpu_verify --dry-run: FAILED")
    assert all(f"| {name} | " in md for name in STEPS)
    # the timed-out step's log tail comes before the table, its junit holds what ran
    assert "----- cuda_tests: timeout" in proc.stdout and "KeyboardInterrupt" in proc.stdout
    with tarfile.open(out / "gpu_verify_logs.tar.gz") as tar:
        names = set(tar.getnames())
        junit = ET.parse(tar.extractfile("gpu_verify/junit/cuda_tests.xml"))
        smoke = tar.extractfile("gpu_verify/logs/smoke.log").read().decode()
        preflight = json.loads(tar.extractfile("gpu_verify/preflight.json").read())
    cases = [c for c in junit.iter("testcase") if "test_ops_scale" in (c.get("classname") or "")]
    assert cases and all(c.find("failure") is None and c.find("skipped") is None for c in cases)
    assert {f"gpu_verify/logs/{name}.log" for name in STEPS} <= names
    assert "gpu_verify/results/fused_step_cpu_gpt2-small.json" in names
    assert any(n.startswith("gpu_verify/results/compare_eager/") and n.endswith(".json") for n in names)
    assert "selftest passed:" in smoke and "ok    adamw_step_" in smoke
    assert preflight["torch"] == torch.__version__ and "ninja" in preflight and "cuda_home" in preflight
    # the plan names the real commands: the forced single-arch build, the sanitizers on our kernels only
    assert "GRADACC_FORCE_CUDA=1" in proc.stdout and "TORCH_CUDA_ARCH_LIST=" in proc.stdout
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING=1" in proc.stdout and proc.stdout.count("kns=gradacc") == 2


def test_spent_budget_skips_every_step_and_still_writes_into_OUT(tmp_path):
    out = tmp_path / "from-env"
    proc = run_script("--dry-run", timeout=120, OUT=str(out), GPU_VERIFY_BUDGET_S="0")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert_output_contract(out, proc.stdout)
    steps = json.loads((out / "summary.json").read_text())["steps"]
    assert [s["step"] for s in steps] == STEPS
    assert {s["status"] for s in steps if s["step"] not in SIMULATED} == {"skipped (budget)"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_real_run_without_a_gpu_stops_with_a_clear_message(tmp_path):
    proc = run_script("--out", str(tmp_path), timeout=120)
    assert proc.returncode == 2 and "sees no CUDA GPU" in proc.stderr and "--dry-run" in proc.stderr
    assert sys.executable in proc.stderr  # which interpreter was asked


def test_unknown_argument_is_rejected():
    proc = run_script("--dryrun", timeout=30)
    assert proc.returncode == 2 and "unknown argument '--dryrun'" in proc.stderr


def test_the_test_paths_the_script_names_exist():
    text = SCRIPT.read_text()
    gpu_checks = re.search(r"^GPU_CHECKS=(\S+)", text, re.M)[1]
    rehearsal = re.search(r"^REHEARSAL_TESTS=\(([^)]*)\)", text, re.M)[1].split()
    suite = re.search(r"^SUITE=(\S+)", text, re.M)[1]
    assert all((ROOT / p).exists() for p in [gpu_checks, suite, *rehearsal])
    assert Path(gpu_checks).name in RUN_BY_PATH  # conftest's "cuda in the id" rule exempts what runs by path


@pytest.mark.skipif(
    not gradacc_ext.extension_loaded() or gradacc_ext.extension_has_cuda(), reason="needs a CPU-only build"
)
def test_kernel_check_stops_a_cpu_only_build():
    proc = helper("gpu_verify_checks.py", "kernels", "--device", "cuda")
    assert proc.returncode == 1 and "the build holds no CUDA kernels" in proc.stdout, proc.stdout + proc.stderr
    assert helper("gpu_verify_checks.py", "kernels", "--device", "cpu").returncode == 0


def junit_file(path: Path, cases: dict[str, str]) -> Path:
    """A junit file with one testcase per name: outcome "passed", "skipped" or "failure"."""
    body = "".join(f'<testcase classname="tests.test_x" name="{n}">'
                   + ("" if o == "passed" else f'<{o} message="{o} here"/>') + "</testcase>"
                   for n, o in cases.items())  # fmt: skip
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')
    return path


@pytest.mark.parametrize(
    ("cases", "flags", "code", "says"),
    [
        ({"test_a[cuda]": "passed", "test_a[cpu]": "skipped"}, [], 0, "1 passed, 0 skipped"),
        ({"test_a[cuda]": "skipped", "test_b[cuda]": "skipped", "test_a[cpu]": "passed"}, [], 1, "nothing was tested"),
        ({"test_a[cpu]": "passed"}, [], 1, "nothing was tested"),
        ({"test_a[cuda]": "passed", "test_b[cuda]": "failure"}, [], 1, "1 failed"),
        ({"test_a[cuda]": "passed", "test_b[cuda]": "skipped"}, ["--no-skips"], 1, "counts as failed"),
        ({"test_a[cuda]": "passed", "test_b[cuda]": "skipped"}, ["--bad-skips", "here$"], 1, "skipped here"),
        ({"test_a[cuda]": "passed", "test_b[cuda]": "skipped"}, ["--bad-skips", "CUDA is not"], 0, "1 skipped"),
    ],
)
def test_junit_check_fails_a_step_that_tested_nothing(tmp_path, cases, flags, code, says):
    proc = helper("gpu_verify_checks.py", "junit", junit_file(tmp_path / "j.xml", cases), "--keyword", "cuda", *flags)
    assert proc.returncode == code and says in proc.stdout, proc.stdout + proc.stderr


def test_junit_check_fails_when_no_junit_was_written(tmp_path):
    proc = helper("gpu_verify_checks.py", "junit", tmp_path / "absent.xml", "--keyword", "cuda")
    assert proc.returncode == 1 and "was not written" in proc.stdout


@pytest.mark.parametrize(
    ("log", "rc", "code"),
    [
        ("========= COMPUTE-SANITIZER\n2.0\n========= ERROR SUMMARY: 0 errors\n", 0, 0),
        ("========= Error: Device not supported. Please refer to the documentation\n", 1, 3),
        ("Traceback (most recent call last):\nModuleNotFoundError: No module named 'torch'\n", 1, 1),
    ],
)
def test_sanitizer_probe_tells_unsupported_from_a_failure(tmp_path, log, rc, code):
    (tmp_path / "probe.log").write_text(log)
    assert helper("gpu_verify_checks.py", "sanitizer", tmp_path / "probe.log", rc).returncode == code


def test_archive_caps_a_huge_log_and_keeps_its_ends(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "logs").mkdir(parents=True)
    (work / "steps.tsv").write_text("memcheck\tfindings\t9\t30.0\t60\t\n")
    noise = os.urandom(12 * 2**20).hex()  # 24 MiB that do not compress below the cap
    (work / "logs" / "memcheck.log").write_text("FIRST LINE\n" + noise + "\nLAST LINE\n")
    proc = helper("gpu_verify_report.py", work, out)
    assert proc.returncode == 1 and proc.stdout.rstrip().endswith("| memcheck | findings | 30.0 | 60 |  |")
    assert (out / "gpu_verify_logs.tar.gz").stat().st_size <= 12 * 2**20
    with tarfile.open(out / "gpu_verify_logs.tar.gz") as tar:
        log = tar.extractfile("gpu_verify/logs/memcheck.log").read()
    assert log.startswith(b"FIRST LINE") and log.endswith(b"LAST LINE\n") and b"bytes cut" in log
    assert "----- memcheck: findings (rc 9)" in proc.stdout and len(proc.stdout) < 12_000


def test_summary_lists_the_fused_step_targets(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from fused_step_targets import gpu_targets, write_json
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    work = tmp_path / "work"
    (work / "results").mkdir(parents=True)
    ours, peer = "gradacc accumulate_final_ + adamw_step_", "torch fused AdamW + foreach clip"
    ms = {ours: 2.0, peer: 2.5}
    targets = gpu_targets(ms, {ours: 90.0, peer: 70.0})
    write_json(work / "results" / "fused_step_cuda_gpt2-small.json", "gpt2-small: 148 tensors", ms,
               dict.fromkeys(ms, 80.0), dict.fromkeys(ms, 0), 3000.0, targets)  # fmt: skip
    (work / "steps.tsv").write_text("bench_step\tok\t0\t12.0\t40\t\n")
    proc = helper("gpu_verify_report.py", work, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "out" / "summary.md").read_text()
    speedup = f"{ours}: speedup vs {peer}"
    assert f"| gpt2-small | {speedup} | 1.25x | >= 1.5x | not met |" in md
    assert f"| gpt2-small | {ours}: % of copy bandwidth (38 B/param) | 90.00% | >= 85% | met |" in md
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [t["status"] for t in summary["fused_step_targets"]] == ["not met", "met"]
    assert proc.stdout.endswith(md)
