"""What the emulation test files (test_emulation.py, test_emulation_optim.py) share: where they run,
the comparison with the C++ CPU kernels, and the Emulator type. The session fixture `emulators`
(conftest.py) builds the library once for both files."""

from __future__ import annotations

import platform
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from _oracle import assert_bitwise_equal

import gradacc_ext

EMULATION_DIR = Path(__file__).resolve().parent / "emulation"
sys.path.insert(0, str(EMULATION_DIR))
import emu_build  # noqa: E402
from emu import Emulator  # noqa: E402

MARKS = [
    pytest.mark.usefixtures("one_cpu_thread"),
    pytest.mark.skipif(
        platform.system() != "Linux" or shutil.which("g++") is None, reason="the emulation needs Linux and g++"
    ),
    pytest.mark.skipif(
        not (EMULATION_DIR.parent.parent / "csrc").is_dir(),
        reason="needs the source tree's csrc/ (CI's wheel run tests a copy of tests/ alone)",
    ),
]
HAS_CPU_KERNELS = gradacc_ext.resolve_backend("cpu")[0] == "ext"

__all__ = ["Emulator", "HAS_CPU_KERNELS", "MARKS", "assert_matches_cpu_kernels", "build_emulators"]


def build_emulators(out_dir: Path) -> dict[str, Emulator]:
    """One emulation library per metadata variant (emu_build.VARIANTS), built under out_dir."""
    return {v: Emulator(emu_build.build(out_dir, v)) for v in emu_build.VARIANTS}


def assert_matches_cpu_kernels(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], what: str) -> None:
    """The element results bit for bit equal to the C++ CPU kernels' (shared element math)."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_bitwise_equal(g, w, f"{what}[{i}]")
