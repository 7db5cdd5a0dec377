"""`gradacc selftest`: passes on the C++ CPU kernels (run as a user runs it), and fails, naming the
kernel and the GRADACC_NO_EXT=1 fallback, when a compiled kernel returns a wrong result."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _devices import require_ext

from gradacc_ext.cli import main
from gradacc_ext.cli.selftest_kernels import KERNELS
from gradacc_ext.ops import api
from gradacc_ext.ops._native import INFO_OPS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def cpu_kernels() -> None:
    require_ext("cpu")


def patch_compiled_op(monkeypatch: pytest.MonkeyPatch, op: str, fn) -> None:
    """The public ops call each compiled op's overload found once in api._OVERLOADS: the fault goes there."""
    monkeypatch.setitem(api._OVERLOADS, op, fn)


def run_selftest(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    try:
        code = main(["selftest", "--device", "cpu", *argv])
    except SystemExit as exc:  # argparse errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out + err


def test_selftest_command_passes_on_the_cpu_kernels():
    proc = subprocess.run([sys.executable, "-m", "gradacc_ext", "selftest", "--device", "cpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("gradacc selftest: the C++ CPU kernels on cpu")
    for kernel in KERNELS:  # one line per kernel, every case over the three layouts
        assert any(ln.split()[:2] == ["ok", kernel.name] and f"{len(kernel.cases)} cases x 3 layouts" in ln
                   for ln in lines), (kernel.name, proc.stdout)  # fmt: skip
    assert lines[-1].startswith(f"selftest passed: {len(KERNELS)} kernels agree with the reference on cpu")


@pytest.mark.parametrize("op", ["accumulate_", "adamw_step_"])
def test_selftest_fails_and_names_a_wrong_kernel(capsys, monkeypatch, op):
    real = getattr(torch.ops.gradacc, op).default

    def wrong(params, *args):  # the kernel's result, one element of the last tensor off
        real(params, *args)
        params[-1].view(-1)[-1].add_(0.25)

    patch_compiled_op(monkeypatch, op, wrong)
    code, out = run_selftest(capsys, "--layouts", "odd")
    assert code == 1, out
    assert any(ln.startswith(f"FAIL  {op} ") and "max |diff|" in ln for ln in out.splitlines()), out
    others = [k.name for k in KERNELS if k.name != op]
    assert all(any(ln.split()[:2] == ["ok", name] for ln in out.splitlines()) for name in others), out
    assert f"selftest FAILED on cpu: {op} disagree(s)" in out and "GRADACC_NO_EXT=1" in out


def test_selftest_reports_a_kernel_that_raises(capsys, monkeypatch):
    def broken(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    patch_compiled_op(monkeypatch, "unscale_", broken)
    code, out = run_selftest(capsys, "--layouts", "odd")
    assert code == 1 and "FAIL  unscale_" in out and "illegal memory access" in out, out


def test_selftest_without_compiled_kernels_fails(capsys, monkeypatch):
    def no_kernels(device, backend="auto"):
        raise RuntimeError("backend='ext' requested for cpu tensors, but GRADACC_NO_EXT=1 is set")

    monkeypatch.setattr("gradacc_ext.cli.selftest.resolve_backend", no_kernels)
    code, out = run_selftest(capsys)
    assert code == 1 and "no compiled kernels to check on cpu" in out and "GRADACC_NO_EXT=1 is set" in out, out


def test_selftest_rejects_an_unknown_layout(capsys):
    code, out = run_selftest(capsys, "--layouts", "odd,diagonal")
    assert code == 2 and "unknown layout(s) diagonal" in out, out


def test_selftest_covers_every_compiled_op():
    """A new op (the next optimizer step) fails this until it has its entry in selftest_kernels.KERNELS."""
    names = torch._C._dispatch_get_all_op_names()
    registered = {n.removeprefix("gradacc::") for n in names if n.startswith("gradacc::")}
    # wgrad_addmm_ (ops/wgrad.py) is torch's own mixed-dtype GEMM behind a Python custom op, not a kernel of ours;
    # it checks itself against float64 once per device before the linear fusion uses it; the info ops
    # (compiled_info, cpu_isa, ...) have no tensor arguments
    assert registered - {"wgrad_addmm_"} - INFO_OPS == {k.name for k in KERNELS}
