"""The `gradacc` command: info (text and JSON), argument errors, plan and bench."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import gradacc_ext
from gradacc_ext.cli import envinfo, main, probe
from gradacc_ext.ops._coverage import arch_coverage


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
        "match": build["built_torch_version"] == torch.__version__.split("+")[0],
    }
    assert info["arch_list"] == build["arch_list"]
    assert set(info["backends"]["cpu"]) == set(envinfo.OPS)
    assert info["backends"]["cpu"]["global_norm"]["backend"] == gradacc_ext.resolve_backend("cpu")[0]
    assert (info["gpus"] is None) == (not torch.cuda.is_available())


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
    ],
)
def test_demo_rejects_bad_arguments(capsys, argv, message):
    expect_usage_error(capsys, message, "demo", *argv)


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
# The quick run itself takes tens of seconds on 2 cores (benchmarks/ tests it); here, its wiring.


def test_bench_prints_the_quick_table_for_the_chosen_device(capsys, monkeypatch):
    from gradacc_ext import benchmarking

    calls = []
    monkeypatch.setattr(benchmarking, "quick_table", lambda device: calls.append(device) or f"| table on {device} |")
    code, out, _ = run_cli(capsys, "bench", "--device", "cpu")
    assert code == 0 and calls == ["cpu"]
    assert out.rstrip().endswith("| table on cpu |")


def test_bench_rejects_unknown_devices(capsys):
    expect_usage_error(capsys, "argument --device: invalid choice: 'tpu'", "bench", "--device", "tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_bench_on_cuda_without_cuda_is_a_usage_error(capsys):
    expect_usage_error(capsys, "--device cuda: CUDA is not available", "bench", "--device", "cuda")


def test_info_without_the_extension_names_the_reason_and_the_fallback():
    env = {**os.environ, "GRADACC_NO_EXT": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "gradacc_ext", "info", "--json"], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["extension_loaded"] is False and "GRADACC_NO_EXT=1" in info["load_reason"]
    assert {choice["backend"] for choice in info["backends"]["cpu"].values()} == {"torch"}
