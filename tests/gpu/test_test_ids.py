"""tests/conftest.py fails the collection on a test that needs CUDA but lacks "cuda" in its id (the GPU
run selects CUDA tests with -k cuda). Checked on a scratch folder holding copies of the conftest."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
CASES = '''
import pytest
import torch
from _devices import CUDA_SKIP


@CUDA_SKIP
def test_needs_a_gpu():
    pass


@pytest.mark.parametrize("where", ["cpu", torch.device("cuda", 0)], ids=["here", "there"])
def test_placed(where):
    pass


@CUDA_SKIP
def test_runs_on_cuda():
    pass


def test_device_fixture(device):
    pass
'''


def collect(tmp_path: Path, source: str) -> subprocess.CompletedProcess:
    for helper in [TESTS / "conftest.py", *TESTS.glob("_*.py")]:
        shutil.copy(helper, tmp_path / helper.name)
    (tmp_path / "test_scratch.py").write_text(source)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "."],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip


def test_a_cuda_test_without_cuda_in_its_id_fails_the_collection(tmp_path):
    proc = collect(tmp_path, CASES)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "2 test(s) need CUDA but have no 'cuda' in their id" in out
    assert "test_scratch.py::test_needs_a_gpu" in out and "test_scratch.py::test_placed[there]" in out
    for fine in ("test_placed[here]", "test_runs_on_cuda", "test_device_fixture["):
        assert f"::{fine}" not in out.split("in their id")[1], out


def test_cuda_tests_named_for_cuda_collect(tmp_path):
    fixed = CASES.replace("test_needs_a_gpu", "test_needs_cuda").replace('"there"', '"cuda0"')
    proc = collect(tmp_path, fixed)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "6 tests collected" in proc.stdout, proc.stdout
