"""The `gradacc` command: info (text and JSON), argument errors, plan and bench."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gradacc_ext
from gradacc_ext.cli import envinfo, main, probe
from gradacc_ext.cli.main import SIGPIPE_EXIT
from gradacc_ext.ops.coverage import arch_coverage
from gradacc_ext.optim import STATE_DTYPES


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    """main(argv) -> (exit code, stdout, stderr); argparse errors exit through SystemExit."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def expect_usage_error(capsys: pytest.CaptureFixture, message: str, *argv: str) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, (code, out, err)
    assert message in err, err
    assert out == ""  # nothing runs and nothing is printed on an error


# -- info -----------------------------------------------------------------------------------------------------------


def test_info_text_lists_versions_and_every_op_backend(capsys):
    code, out, _ = run_cli(capsys, "info")
    assert code == 0
    assert f"gradacc_ext {gradacc_ext.__version__}" in out
    assert f"running {torch.__version__}" in out
    backend, reason = gradacc_ext.resolve_backend("cpu", "auto")
    for op in envinfo.OPS:
        line = next(line for line in out.splitlines() if line.split()[:2] == ["cpu", op])
        assert line.split()[2] == backend and reason in line
    cuda_rows = [line for line in out.splitlines() if line.split()[:1] == ["cuda"]]
    assert len(cuda_rows) == (len(envinfo.OPS) if torch.cuda.is_available() else 0)


def test_info_json_matches_build_info():
    # Through `python -m gradacc_ext`, so the module entry point is covered too.
    proc = subprocess.run(
        [sys.executable, "-m", "gradacc_ext", "info", "--json"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    build = gradacc_ext.build_info()
    assert info["version"] == gradacc_ext.__version__
    assert info["extension_loaded"] == build["extension_loaded"]
    assert info["torch"] == {
        "built": build["built_torch_version"],
        "running": torch.__version__,
        "abi": "stable",
        "min": build["min_torch_version"],
        "match": True,
    }
    assert info["arch_list"] == build["arch_list"]
    assert set(info["backends"]["cpu"]) == set(envinfo.OPS)
    assert info["backends"]["cpu"]["global_norm"]["backend"] == gradacc_ext.resolve_backend("cpu")[0]
    assert (info["gpus"] is None) == (not torch.cuda.is_available())


def test_info_lists_the_optimizer_state_storages_each_device_takes(capsys):
    info = envinfo.collect()
    assert envinfo.state_storages("torch") == list(STATE_DTYPES)  # the reference takes every storage
    # this build's C++ kernels take them all too (a stale build without the scales lists would say only fp32)
    assert info["state_storages"]["cpu"] == list(STATE_DTYPES)
    code, out, _ = run_cli(capsys, "info")
    assert code == 0 and "states:     cpu optimizer state_dtype: fp32, bf16, int8" in out


@pytest.mark.parametrize(
    ("arch_list", "capability", "covered"),
    [
        ("8.0;9.0+PTX", (8, 0), True),  # exact binary
        ("8.0;9.0+PTX", (8, 6), True),  # same major, newer minor: the 8.0 binary runs
        ("8.0;9.0+PTX", (9, 0), True),
        ("8.0;9.0+PTX", (10, 0), True),  # newer major: only through the 9.0 PTX
        ("8.0;9.0+PTX", (7, 5), False),  # older than everything built
        ("8.0 8.6", (9, 0), False),  # no PTX: a newer major has nothing to run
        ("9.0a", (9, 0), True),
        ("9.0a", (10, 0), False),  # arch-specific binaries run on exactly 9.0
        (None, (8, 0), False),
    ],
)
def test_arch_coverage(arch_list, capability, covered):
    ok, reason = arch_coverage(arch_list, capability)
    assert ok is covered, reason
    assert f"{capability[0]}.{capability[1]}" in reason or arch_list is None


# -- argument errors --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--grad-accum-steps", "0"), "argument --grad-accum-steps: must be an integer >= 1, got 0"),
        (("--batch-size", "two"), "argument --batch-size: must be an integer >= 1, got two"),
        (("--steps", "-3"), "argument --steps: must be an integer >= 1, got -3"),
        (("--lr", "0"), "argument --lr: must be a finite number > 0, got 0"),
        (("--lr", "nan"), "argument --lr: must be a finite number > 0, got nan"),
        (("--max-grad-norm", "-1"), "argument --max-grad-norm: must be a finite number >= 0 (0 disables clipping)"),
        (("--amp", "fp8"), "argument --amp: invalid choice: 'fp8'"),
        (("--d-model", "30"), "--d-model must be a multiple of 4 (the head count), got 30"),
        (("--max-len", "7"), "argument --max-len: must be an integer in [8, 1024], got 7"),
        (("--max-len", "100000"), "argument --max-len: must be an integer in [8, 1024], got 100000"),
        (("--out", "/missing/dir/x.png"), "--out /missing/dir/x.png: folder /missing/dir does not exist"),
    ],
)
def test_demo_rejects_bad_arguments(capsys, argv, message):
    expect_usage_error(capsys, message, "demo", *argv)


def test_demo_out_is_checked_before_training(capsys, tmp_path, monkeypatch):
    from gradacc_ext.cli import demo

    monkeypatch.setattr(demo, "run", lambda cfg: pytest.fail("trained although --out cannot be written"))
    expect_usage_error(capsys, f"--out {tmp_path}: is a folder", "demo", "--out", str(tmp_path))
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if not os.access(locked, os.W_OK):  # root can write anywhere
        expect_usage_error(capsys, "is not writable", "demo", "--out", str(locked / "x.png"))


def test_info_into_a_closed_pipe_exits_quietly():
    # `gradacc info | head -1`: the reader is gone before the output is written.
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradacc_ext", "info"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == SIGPIPE_EXIT
    assert err.decode() == ""  # no BrokenPipeError traceback, no "Exception ignored" line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_demo_device_cuda_without_cuda_is_a_usage_error(capsys):
    expect_usage_error(capsys, "--device cuda: CUDA is not available", "demo", "--device", "cuda")


def test_missing_subcommand_is_a_usage_error(capsys):
    code, _, err = run_cli(capsys)
    assert code == 2 and "required" in err


# -- plan -----------------------------------------------------------------------------------------------------------


def plan_rows(out: str) -> dict[str, str]:
    return {
        name.strip(): value.strip() for name, value in (line.split("|", 1) for line in out.splitlines() if "|" in line)
    }


def test_plan_table_exact_target_with_lr_scaling(capsys):
    code, out, _ = run_cli(
        capsys,
        "plan",
        "--target-batch",
        "256",
        "--micro-batch",
        "8",
        "--world-size",
        "4",
        "--base-lr",
        "3e-4",
        "--base-batch",
        "32",
    )
    assert code == 0
    rows = plan_rows(out)
    assert rows["micro-batch per rank"] == "8" and rows["accumulation steps"] == "8"
    assert rows["effective batch"] == "256 (exact)"
    assert float(rows["scaled LR, linear"].split()[0]) == pytest.approx(3e-4 * 256 / 32, rel=1e-3)
    assert float(rows["scaled LR, sqrt"].split()[0]) == pytest.approx(3e-4 * 8**0.5, rel=1e-3)
    assert "micro-batch 8 x steps 8 x world 4 = effective batch 256" in out


def test_plan_json_inexact_target_says_so(capsys):
    code, out, _ = run_cli(
        capsys, "plan", "--target-batch", "250", "--micro-batch", "16", "--world-size", "4", "--json"
    )
    assert code == 0
    plan = json.loads(out)
    assert (plan["micro_batch_size"], plan["accumulation_steps"], plan["world_size"]) == (16, 4, 4)
    assert plan["effective_batch_size"] == 256 and plan["exact"] is False
    assert "250" in plan["note"] and "lr_linear" not in plan
    assert plan["micro_batch_size"] * plan["accumulation_steps"] * plan["world_size"] == plan["effective_batch_size"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--target-batch", "0", "--micro-batch", "4"), "argument --target-batch: must be an integer >= 1, got 0"),
        (
            ("--target-batch", "64", "--micro-batch", "4", "--world-size", "0"),
            "argument --world-size: must be an integer >= 1, got 0",
        ),
        (
            (
                "--target-batch",
                "64",
            ),
            "one of the arguments --micro-batch --probe is required",
        ),
        (("--target-batch", "64", "--micro-batch", "4", "--probe"), "not allowed with argument"),
        (("--target-batch", "64", "--micro-batch", "4", "--base-lr", "1e-3"), "--base-lr and --base-batch go together"),
        (
            ("--target-batch", "64", "--micro-batch", "4", "--base-lr", "-1", "--base-batch", "8"),
            "argument --base-lr: must be a finite number > 0, got -1",
        ),
        (("--target-batch", "2", "--micro-batch", "4", "--world-size", "4"), "smaller than world_size=4"),
    ],
)
def test_plan_rejects_bad_input(capsys, argv, message):
    expect_usage_error(capsys, message, "plan", *argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_plan_probe_without_cuda_is_a_clear_error(capsys):
    expect_usage_error(capsys, "--probe needs a CUDA GPU", "plan", "--target-batch", "64", "--probe")


def test_probe_run_holds_training_memory_and_runs_backward():
    run = probe.ProbeRun("demo", 12, "no", torch.device("cpu"))
    assert all(bool((p.grad == 0).all()) for p in run.model.parameters())  # held, as in training
    assert all(len(run.optimizer.state[p]) > 0 for p in run.model.parameters())
    run(3)  # one forward and backward of 3 sequences of 12 tokens
    assert all(bool(p.grad.abs().sum() > 0) for p in run.model.parameters())


@pytest.mark.parametrize(("kwargs", "message"), [({"preset": "gpt5"}, "preset"), ({"seq_len": 4096}, "seq_len")])
def test_probe_rejects_bad_settings(kwargs, message):
    settings = {"preset": "demo", "seq_len": 8, "amp": "no", "device": torch.device("cpu")} | kwargs
    with pytest.raises(ValueError, match=message):
        probe.ProbeRun(**settings)


# -- bench ----------------------------------------------------------------------------------------------------------
# The default run takes tens of seconds on 2 cores; here it runs on a tiny workload, everything else real.


@pytest.fixture
def tiny_bench(monkeypatch):
    from gradacc_ext import benchmarking
    from gradacc_ext.benchmarking import runner, timing

    monkeypatch.setattr(benchmarking, "CLI_WORKLOADS", "gpt2-small=0.02")
    for module in (timing, runner):  # input sets and roofline streams of 1 MiB
        monkeypatch.setattr(module, "rotation_bytes", lambda device, cache_multiple=8: 1 << 20)
    fast = timing.TimingConfig(threshold=0.5, min_time_s=0.0, max_time_s=0.01)
    monkeypatch.setattr(benchmarking, "CLI_TIMING", {"default": fast, "quick": fast})


@pytest.mark.parametrize("quick", [False, True])
def test_bench_prints_a_table_and_nothing_else_on_stderr(capfd, tiny_bench, quick):
    from gradacc_ext import benchmarking

    before = torch.get_num_threads()
    code = main(["bench", "--device", "cpu", "--threads", "1", *(["--quick"] if quick else [])])
    out, err = capfd.readouterr()  # file descriptors: C++ prints (the profiler's) would show here
    assert code == 0 and torch.get_num_threads() == before  # --threads applies to the run only
    assert err.splitlines() == [err.splitlines()[0]] and "1 CPU thread" in err  # the one status line
    rows = [line for line in out.splitlines() if line.startswith("| gpt2-small |")]
    ops = benchmarking.CLI_OPERATIONS["quick" if quick else "default"].split(",")
    impls = benchmarking.CLI_IMPLS["quick" if quick else "default"]
    assert len(rows) == 1 + len(ops) * len(impls)  # the workloads table's row, then one per cell
    assert "1 CPU thread;" in out and "IQR/median" in out


def test_bench_threads_reach_the_timer():
    from gradacc_ext import benchmarking

    config = benchmarking.cli_config("cpu", quick=True, threads=3)
    assert config.timing.threads == 3 and not config.count_launches
    assert benchmarking.cli_config("cpu").timing.threads is None


def test_bench_rejects_bad_threads(capsys):
    expect_usage_error(capsys, "argument --threads: must be an integer >= 1, got 0", "bench", "--threads", "0")


def test_bench_rejects_unknown_devices(capsys):
    expect_usage_error(capsys, "argument --device: invalid choice: 'tpu'", "bench", "--device", "tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_bench_on_cuda_without_cuda_is_a_usage_error(capsys):
    expect_usage_error(capsys, "--device cuda: CUDA is not available", "bench", "--device", "cuda")


def test_info_without_the_extension_names_the_reason_and_the_fallback():
    # Without GRADACC_REQUIRE_EXT, which a run that forbids the fall-back sets (scripts/torch_matrix.sh):
    # with both flags the import fails on purpose (tests/ops/test_ops_registration.py covers that).
    env = {k: v for k, v in os.environ.items() if k != "GRADACC_REQUIRE_EXT"} | {"GRADACC_NO_EXT": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "gradacc_ext", "info", "--json"], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["extension_loaded"] is False and "GRADACC_NO_EXT=1" in info["load_reason"]
    assert {choice["backend"] for choice in info["backends"]["cpu"].values()} == {"torch"}


# -- quickstart -----------------------------------------------------------------------------------------------------
# Its first run creates a virtual environment and builds (minutes, network); here, the decision to skip the build.

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "scripts" / "quickstart.sh"
source_tree_only = pytest.mark.skipif(not QUICKSTART.exists(), reason="needs the source tree (CI's wheel run has none)")


def load_build_stamp():
    spec = importlib.util.spec_from_file_location("build_stamp", ROOT / "scripts" / "build_stamp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@source_tree_only
def test_quickstart_with_an_unchanged_build_starts_the_demo_without_building(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    # A stand-in environment: this interpreter, the package from this tree, and a pip that refuses to run
    # (an attempted install fails the test instead of installing anything).
    no_pip = 'case "$1 $2" in "-m pip") echo "pip was called" >&2; exit 97;; esac'
    python = sys.executable
    scripts = {"python": f'{no_pip}\nexec {python} "$@"', "gradacc": f'exec {python} -m gradacc_ext "$@"'}
    for name, body in scripts.items():
        (venv / "bin" / name).write_text(f"#!/bin/sh\nexport PYTHONPATH={ROOT}\n{body}\n")
        (venv / "bin" / name).chmod(0o755)
    (venv / ".gradacc-build-stamp").write_text(load_build_stamp().fingerprint() + "\n")
    env = {**os.environ, "GRADACC_VENV": str(venv)}
    proc = subprocess.run([str(QUICKSTART), "demo", "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "up to date" in proc.stdout and "== building" not in proc.stdout
    assert "usage: gradacc demo" in proc.stdout


@source_tree_only
def test_build_stamp_changes_with_what_the_build_depends_on(tmp_path, monkeypatch):
    stamp = load_build_stamp()
    for name in ("csrc", "setup.py", "pyproject.toml"):
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, tmp_path / name)
    (tmp_path / "gradacc_ext").mkdir()
    first = stamp.fingerprint(tmp_path)
    assert stamp.fingerprint(tmp_path) == first  # deterministic
    kernel = next((tmp_path / "csrc").rglob("*.cpp"))
    kernel.write_text(kernel.read_text() + "\n// changed\n")
    second = stamp.fingerprint(tmp_path)
    assert second != first
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    third = stamp.fingerprint(tmp_path)
    assert third != second
    (tmp_path / "gradacc_ext" / "_C.so").write_bytes(b"built")
    assert stamp.fingerprint(tmp_path) != third  # a new (or deleted) library means a new build


@source_tree_only
def test_packaging_metadata_uses_spdx_and_lists_tqdm():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "BSD-3-Clause"  # an SPDX expression, not the deprecated {text = ...} table
    assert any(dep.startswith("tqdm") for dep in project["dependencies"])


def setup_version(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`python setup.py --version` in a copy of the build files (setup.py writes its build config next to
    itself), with `env` added: what the wheel would be named, without building anything."""
    tree = tmp_path / "tree"
    (tree / "gradacc_ext").mkdir(parents=True)
    for name in ("setup.py", "pyproject.toml", "README.md", "gradacc_ext/__init__.py"):  # __init__: the version
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / "csrc" / "compat", tree / "csrc" / "compat")  # setup.py reads the glibc pins' names
    return subprocess.run(
        [sys.executable, "setup.py", "--version"], cwd=tree, capture_output=True, text=True,
        env={**os.environ, **env}, timeout=300,
    )  # fmt: skip


@source_tree_only
def test_setup_without_numpy_prints_no_warning(tmp_path):
    # A fresh venv builds before numpy arrives (it comes with the `test` extra); torch warns at import then.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['numpy'] = None  # as if not installed\n")
    proc = setup_version(tmp_path, PYTHONPATH=str(site), GRADACC_NO_EXT="0")
    assert proc.returncode == 0, proc.stderr
    assert "NumPy" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr


@source_tree_only
@pytest.mark.parametrize(
    ("env", "suffix"),
    [({"GRADACC_NO_CUDA": "1"}, ""), ({"GRADACC_NO_EXT": "1"}, ""), ({"GRADACC_FORCE_CUDA": "1"}, "+cu")],
    ids=["cpu", "no_ext", "force_cuda"],
)
def test_setup_names_the_cuda_wheel_by_its_toolkit(tmp_path, env, suffix):
    """The CUDA wheel's version carries the nvcc it was built with (0.1.0+cu130), as torch names its CUDA wheels;
    the CPU and pure-Python ones carry none. GRADACC_FORCE_CUDA=1 needs only nvcc, a CPU torch will do."""
    if suffix and shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists():
        pytest.skip("no nvcc: the CUDA variant cannot be configured here")
    proc = setup_version(tmp_path, **{"GRADACC_NO_EXT": "0", "GRADACC_NO_CUDA": "0", "GRADACC_FORCE_CUDA": "0", **env})
    assert proc.returncode == 0, proc.stderr
    version = proc.stdout.strip().splitlines()[-1]
    assert version.startswith(gradacc_ext.__version__), version
    local = version.removeprefix(gradacc_ext.__version__)
    if suffix:
        nvcc = subprocess.run(
            [shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc", "--version"], capture_output=True, text=True
        ).stdout
        release = nvcc.split("release ")[1].split(",")[0]
        assert local == "+cu" + release.replace(".", ""), version
    else:
        assert local == "", version
