"""The built _C fits manylinux_2_28 (torch's own tag): no glibc, libstdc++ or libgcc symbol version above it
(setup.py's glibc pins, csrc/compat/), and scripts/check_glibc_versions.py, the wheel build's check, fails an
object that needs more."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gradacc_ext

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "check_glibc_versions.py"
pytestmark = [
    pytest.mark.skipif(not CHECK.exists(), reason="needs the source tree's scripts/"),
    pytest.mark.skipif(
        platform.machine() != "x86_64" or platform.libc_ver()[0] != "glibc" or shutil.which("objdump") is None,
        reason="the pins and the check are for x86-64 glibc, read with objdump",
    ),
]


def run_check(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), *map(str, paths)], capture_output=True, text=True, timeout=60)


def test_built_extension_fits_manylinux_2_28() -> None:
    if not gradacc_ext.extension_loaded():
        pytest.skip("the compiled extension is not built here")
    so = Path(gradacc_ext._C.__file__)
    result = run_check(so)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fits manylinux_2_28" in result.stdout
    # _C's own __libc_single_threaded is hidden: nothing outside _C can see or change it.
    exported = subprocess.run(["objdump", "-T", str(so)], capture_output=True, text=True, check=True).stdout
    assert "__libc_single_threaded" not in exported


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_check_fails_an_object_that_needs_a_newer_glibc(tmp_path: Path) -> None:
    # glibc >= 2.34 binds dlopen at GLIBC_2.34 (the build machine's glibc is 2.36), above manylinux_2_28's 2.28.
    if tuple(int(x) for x in platform.libc_ver()[1].split(".")[:2]) < (2, 34):
        pytest.skip("this glibc binds dlopen at a version manylinux_2_28 allows")
    src = tmp_path / "uses_dlopen.c"
    src.write_text('#include <dlfcn.h>\nvoid* f(void) { return dlopen("libm.so.6", RTLD_NOW); }\n')
    so = tmp_path / "uses_dlopen.so"
    subprocess.run(["cc", "-shared", "-fPIC", str(src), "-o", str(so)], check=True, timeout=60)
    result = run_check(so)
    assert result.returncode == 1
    assert "dlopen needs GLIBC_2.34, above manylinux_2_28's GLIBC_2.28" in result.stdout
