"""Which release wheel fits this machine: glibc, the NVIDIA driver, the GPU and torch (docs/install.md).

Standard library only, and no import of torch or gradacc_ext: `python scripts/which_wheel.py` runs it before
anything is installed, and `gradacc info` after. The rules are the install table's:
  - x86-64 Linux with glibc >= 2.28 (the wheels are manylinux_2_28, as torch's are); else build from source;
  - torch >= 2.11 (the stable ABI's floor), a CUDA build of it for the CUDA kernels;
  - the CUDA wheels carry their runtime inside (linked statically), so only the driver has to support it:
    cu130 needs a driver for CUDA 13.0 (r580+), cu124 any driver for CUDA 12 (r525.60.13+);
  - the GPU: cu130 has no sm_70 (V100, dropped by CUDA 13), cu124 none for sm_100+ but their JIT PTX.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
from dataclasses import dataclass
from importlib import util
from pathlib import Path

MIN_GLIBC = (2, 28)
MIN_TORCH = (2, 11)
CU130_DRIVER = (13, 0)
CU12_DRIVER = (12, 0)
# How to install each variant from scripts/build_wheels.sh's output (one --find-links folder per variant).
INSTALL = {variant: f"pip install --find-links dist/{variant} gradacc_ext" for variant in ("cpu", "cu130", "cu124")}


@dataclass
class Machine:
    """The facts the choice rests on; None where a fact could not be read."""

    machine: str
    glibc: tuple[int, int] | None
    torch: tuple[int, int] | None
    torch_cuda: str | None
    driver_cuda: tuple[int, int] | None
    gpu_capability: tuple[int, int] | None


def _version(text: str | None) -> tuple[int, int] | None:
    found = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(found.group(1)), int(found.group(2))) if found else None


def _torch_versions() -> tuple[tuple[int, int] | None, str | None]:
    """torch's release and CUDA, read from torch/version.py without importing torch (fast, and safe here)."""
    spec = util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None, None
    text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    release = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", text, re.MULTILINE)
    cuda = re.search(r"^cuda\s*(?::\s*\S+\s*)?=\s*['\"]([^'\"]+)", text, re.MULTILINE)
    return _version(release.group(1) if release else None), cuda.group(1) if cuda else None


def _driver() -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """(the newest CUDA the driver supports, device 0's compute capability), from libcuda; (None, None) without one."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None, None
    version = ctypes.c_int(0)
    if cuda.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value == 0:
        return None, None
    driver = (version.value // 1000, version.value % 1000 // 10)
    major, minor = ctypes.c_int(0), ctypes.c_int(0)
    if cuda.cuInit(0) != 0:
        return driver, None
    # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75, _MINOR = 76, of device ordinal 0.
    if cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, 0) or cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, 0):
        return driver, None
    return driver, (major.value, minor.value)


def probe() -> Machine:
    libc, libc_version = platform.libc_ver()
    torch, torch_cuda = _torch_versions()
    driver, capability = _driver() if os.name == "posix" else (None, None)
    return Machine(
        machine=platform.machine(),
        glibc=_version(libc_version) if libc == "glibc" else None,
        torch=torch,
        torch_cuda=torch_cuda,
        driver_cuda=driver,
        gpu_capability=capability,
    )


def choose(m: Machine) -> tuple[str | None, str]:
    """(the variant: "cpu", "cu130", "cu124", or None for "build from source", the reason in a sentence)."""
    if m.machine not in ("x86_64", "AMD64") or m.glibc is None:
        return None, f"the wheels are for x86-64 Linux with glibc; this is {m.machine} without glibc: build from source"
    if m.glibc < MIN_GLIBC:
        return (
            None,
            f"glibc {m.glibc[0]}.{m.glibc[1]} is older than the wheels' 2.28 (manylinux_2_28): build from source",
        )
    if m.torch is not None and m.torch < MIN_TORCH:
        return None, f"torch {m.torch[0]}.{m.torch[1]} is older than 2.11, the wheels' floor: upgrade torch first"
    if m.torch is not None and m.torch_cuda is None:
        return "cpu", "torch is a CPU build, so CUDA kernels could not run beside it"
    if m.driver_cuda is None:
        return "cpu", "no NVIDIA driver found (libcuda.so.1)"
    driver = f"the driver supports CUDA {m.driver_cuda[0]}.{m.driver_cuda[1]}"
    v100 = m.gpu_capability is not None and m.gpu_capability < (7, 5)
    if m.driver_cuda >= CU130_DRIVER and not v100:
        return "cu130", f"{driver}, enough for the CUDA 13.0 runtime the cu130 wheel carries inside"
    if m.driver_cuda >= CU12_DRIVER:
        why = "the GPU is sm_70, which CUDA 13 dropped" if v100 and m.driver_cuda >= CU130_DRIVER else driver
        return "cu124", f"{why}; the cu124 wheel carries a CUDA 12 runtime inside, which any CUDA 12 driver runs"
    return "cpu", f"{driver}, older than CUDA 12: no CUDA wheel runs on it (build from source with your toolkit)"


def describe(m: Machine) -> list[str]:
    """The facts and the verdict, one line each (which_wheel.py prints them; `gradacc info` adds them)."""
    fmt = lambda v: f"{v[0]}.{v[1]}" if v else "none"  # noqa: E731
    variant, reason = choose(m)
    return [
        f"machine {m.machine}, glibc {fmt(m.glibc)}, torch {fmt(m.torch)} (CUDA {m.torch_cuda or 'none'}), "
        f"driver for CUDA {fmt(m.driver_cuda)}, GPU compute {fmt(m.gpu_capability)}",
        f"wheel: {variant or 'none'}: {reason}",
        *([f"       {INSTALL[variant]}"] if variant else []),
    ]
