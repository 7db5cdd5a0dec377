"""Whether the compiled CUDA kernels can run on a given GPU, decided once per device.

Two things must hold, or every launch fails ("no kernel image is available",
"invalid argument"):

* Architecture: the build's TORCH_CUDA_ARCH_LIST holds a binary for the GPU's
  compute capability (a cubin for X.Y runs on X.Z with Z >= Y; an
  arch-specific 9.0a only on 9.0), or PTX for an older arch, which the driver
  JIT-compiles (a slow first launch, then cached).
* Kernel parameters: a build with CUDA 12.1+ passes up to 32 KB of tensor-list
  metadata as __grid_constant__ parameters (csrc/kernels/multi_tensor.cuh),
  which needs a driver of CUDA 12.1 or newer (R530+) too. A build with an
  older CUDA uses the 4 KB limit and needs nothing more.

When either fails, the ops use the pure-PyTorch reference on that device and
warn once, naming the reason and the fix. The decision (decide()) is a pure
function of DeviceFacts, so it is tested on any machine with mocked facts.
"""

from __future__ import annotations

import ctypes
import re
import warnings
from dataclasses import dataclass

import torch

from ._loader import build_info

LARGE_PARAMS_CUDA = (12, 1)  # CUDA version (runtime and driver) of 32 KB kernel parameters
_ARCH = re.compile(r"^(\d+)\.(\d+)([a-z]?)(\+PTX)?$")


def parse_arch_list(arch_list: str) -> list[tuple[int, int, str, bool]]:
    """TORCH_CUDA_ARCH_LIST ("8.0;9.0+PTX", also space-separated) -> [(major, minor, suffix, ptx)].

    Entries that are not of the X.Y[a][+PTX] form are skipped.
    """
    entries = []
    for item in re.split(r"[;\s]+", arch_list.strip()):
        match = _ARCH.match(item)
        if match:
            entries.append((int(match[1]), int(match[2]), match[3], bool(match[4])))
    return entries


def arch_coverage(arch_list: str | None, capability: tuple[int, int]) -> tuple[bool, str]:
    """Whether kernels built for `arch_list` run on a GPU of compute `capability`, and why."""
    major, minor = capability
    name = f"{major}.{minor}"
    if not arch_list:
        return False, "the extension has no CUDA kernels"
    for a_major, a_minor, suffix, _ in parse_arch_list(arch_list):
        exact = (a_major, a_minor) == (major, minor)
        if exact or (not suffix and a_major == major and a_minor < minor):
            return True, f"compute {name} runs the {a_major}.{a_minor}{suffix} binary"
    for a_major, a_minor, _, ptx in parse_arch_list(arch_list):
        if ptx and (a_major, a_minor) <= (major, minor):
            return True, f"compute {name} JIT-compiles the {a_major}.{a_minor} PTX (slow first launch)"
    return False, (
        f"no binary or PTX in {arch_list!r} runs on compute {name}: rebuild with TORCH_CUDA_ARCH_LIST including {name}"
    )


def _version(text: str | None) -> tuple[int, int] | None:
    match = re.match(r"^(\d+)\.(\d+)", text or "")
    return (int(match[1]), int(match[2])) if match else None


@dataclass(frozen=True)
class DeviceFacts:
    """What the decision needs to know about one GPU and the build."""

    device: str  # "cuda:0"
    name: str
    capability: tuple[int, int]
    driver_cuda: tuple[int, int] | None  # the newest CUDA the driver supports; None if unknown
    built_cuda: str | None  # the CUDA version the extension was built with
    arch_list: str | None  # its TORCH_CUDA_ARCH_LIST; None without CUDA kernels


@dataclass(frozen=True)
class Coverage:
    device: str
    name: str
    capability: str
    covered: bool
    path: str  # "fused CUDA kernels" or "pure-PyTorch reference"
    reason: str


def decide(facts: DeviceFacts) -> Coverage:
    """The path for a device: the fused kernels when both checks pass, else the reference, with why."""
    cap = f"{facts.capability[0]}.{facts.capability[1]}"

    def result(covered: bool, reason: str) -> Coverage:
        path = "fused CUDA kernels" if covered else "pure-PyTorch reference"
        return Coverage(facts.device, facts.name, cap, covered, path, reason)

    arch_ok, arch_reason = arch_coverage(facts.arch_list, facts.capability)
    if not arch_ok:
        return result(False, f"{facts.device} ({facts.name}): {arch_reason}")
    built = _version(facts.built_cuda)
    if built is not None and built >= LARGE_PARAMS_CUDA and facts.driver_cuda is not None:
        if facts.driver_cuda < LARGE_PARAMS_CUDA:
            have = f"{facts.driver_cuda[0]}.{facts.driver_cuda[1]}"
            return result(
                False,
                f"{facts.device} ({facts.name}): the kernels were built with CUDA {facts.built_cuda} and pass 32 KB "
                f"kernel parameters, which need a driver for CUDA 12.1+ (R530 or newer), but this driver supports "
                f"CUDA {have}: update the NVIDIA driver, or build the extension with a CUDA toolkit older than 12.1",
            )
    return result(True, arch_reason)


def driver_cuda_version() -> tuple[int, int] | None:
    """The newest CUDA version the installed driver supports (cuDriverGetVersion), or None."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return version.value // 1000, (version.value % 1000) // 10


def device_facts(index: int) -> DeviceFacts:
    build = build_info()
    return DeviceFacts(
        device=f"cuda:{index}",
        name=torch.cuda.get_device_name(index),
        capability=tuple(torch.cuda.get_device_capability(index)),
        driver_cuda=driver_cuda_version(),
        built_cuda=build["built_cuda_version"],
        arch_list=build["arch_list"] if build["with_cuda"] else None,
    )


# Decisions by device index. A plain dict, not functools.cache: after the first (eager) use an op
# traced by torch.compile sees only a dict lookup here.
_DECIDED: dict[int, Coverage] = {}


def device_coverage(index: int) -> Coverage:
    """The decision for GPU `index`, made on its first use; an uncovered GPU warns here, once."""
    coverage = _DECIDED.get(index)
    if coverage is None:
        coverage = _DECIDED[index] = decide(device_facts(index))
        if not coverage.covered:
            warnings.warn(
                f"gradacc_ext: {coverage.reason}. The ops use the pure-PyTorch reference on this GPU "
                "(same results within the documented tolerances, slower).",
                RuntimeWarning,
                stacklevel=4,
            )
    return coverage


def forget() -> None:
    """Drops every decision, so the next use decides again (tests that mock the device facts)."""
    _DECIDED.clear()


def cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()
