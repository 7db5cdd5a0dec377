"""scripts/check_wheel_archs.py's reading of an arch list: which SASS and PTX a CUDA wheel must hold."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_wheel_archs.py"
pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="needs the source tree's scripts/")


def load():
    spec = importlib.util.spec_from_file_location("check_wheel_archs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("arch_list", "sass", "ptx"),
    [
        ("7.5;8.0;9.0;10.0;11.0;12.0+PTX", {"sm_75", "sm_80", "sm_90", "sm_100", "sm_110", "sm_120"}, {"sm_120"}),
        ("7.0;7.5;8.0;9.0+PTX", {"sm_70", "sm_75", "sm_80", "sm_90"}, {"sm_90"}),
        ("9.0", {"sm_90"}, set()),
        ("8.0 9.0+PTX", {"sm_80", "sm_90"}, {"sm_90"}),
    ],
)
def test_arch_list_to_device_code(arch_list: str, sass: set[str], ptx: set[str]) -> None:
    assert load().expected(arch_list) == (sass, ptx)
