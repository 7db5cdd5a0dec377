"""Which wheel fits a machine (gradacc_ext/cli/wheel_choice.py, behind scripts/which_wheel.py and `gradacc info`):
the install table's rules, one machine per row, and both front ends print the same verdict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gradacc_ext.cli import envinfo, wheel_choice
from gradacc_ext.cli.wheel_choice import Machine

ROOT = Path(__file__).resolve().parents[2]
H100 = (9, 0)
V100 = (7, 0)


def machine(**facts) -> Machine:
    base = dict(
        machine="x86_64", glibc=(2, 28), torch=(2, 11), torch_cuda="12.6", driver_cuda=(13, 0), gpu_capability=H100
    )
    return Machine(**{**base, **facts})


@pytest.mark.parametrize(
    ("facts", "variant"),
    [
        ({}, "cu130"),  # RHEL 8's glibc, a CUDA 13 driver: the newest wheel, whatever CUDA torch was built with
        ({"driver_cuda": (12, 2)}, "cu124"),  # an r535 driver: CUDA 12's runtime inside is enough for it
        ({"driver_cuda": (12, 0)}, "cu124"),  # the oldest CUDA 12 driver
        ({"driver_cuda": (13, 1), "gpu_capability": V100}, "cu124"),  # CUDA 13 dropped sm_70
        ({"driver_cuda": (11, 8)}, "cpu"),  # no CUDA wheel runs on a CUDA 11 driver
        ({"driver_cuda": None, "gpu_capability": None}, "cpu"),  # no driver
        ({"torch_cuda": None}, "cpu"),  # a CPU torch: CUDA kernels could not run
        ({"torch": None, "torch_cuda": None}, "cu130"),  # torch not installed yet: by the driver
        ({"glibc": (2, 27)}, None),  # older than manylinux_2_28
        ({"glibc": (2, 26), "driver_cuda": (12, 4)}, None),  # Amazon Linux 2
        ({"machine": "aarch64"}, None),
        ({"glibc": None}, None),  # musl
        ({"torch": (2, 10)}, None),  # below the stable-ABI floor
    ],
)
def test_choice_follows_the_install_table(facts: dict, variant: str | None) -> None:
    chosen, reason = wheel_choice.choose(machine(**facts))
    assert chosen == variant, reason
    assert reason


def test_which_wheel_script_and_gradacc_info_agree() -> None:
    script = ROOT / "scripts" / "which_wheel.py"
    if not script.exists():
        pytest.skip("needs the source tree's scripts/")
    # -S -I: plain Python without site-packages (no torch, no gradacc_ext), as before an install.
    bare = subprocess.run([sys.executable, "-S", "-I", str(script)], capture_output=True, text=True, timeout=60)
    assert bare.returncode == 0, bare.stderr
    assert "torch none" in bare.stdout and "wheel: " in bare.stdout
    here = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    info = envinfo.collect()["wheel"]
    assert f"wheel: {info['fits'] or 'none'}: {info['reason']}" in here.stdout
    assert info["facts"] in here.stdout
