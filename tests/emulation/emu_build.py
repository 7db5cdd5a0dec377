"""Builds the host emulation of the CUDA kernels (tests/emulation/test_emulation.py).

csrc/kernels/ and csrc/cuda/ are copied with two mechanical rewrites that g++
needs, and nothing else: the launch syntax ``k<<<grid, block, shmem, stream>>>(args)``
becomes ``::emu::launch(k, grid, block, shmem, stream)(args)``, and a
``const __grid_constant__ T name`` parameter becomes ``const T& name`` (one
shared, read-only copy, as on the GPU). Then g++ compiles them with
shim/cuda_runtime_api.h in place of the toolkit's header and the C entry
points of emu_ops.cpp and emu_optim.cpp into a shared library loaded with ctypes.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^<>;]*>)?)<<<(.*?)>>>\(", re.S)
GRID_CONSTANT = re.compile(r"__grid_constant__\s+([\w:]+(?:<[^<>]*>)?)\s+(\w+)")
# CUDART_VERSION picks the metadata budget (multi_tensor.cuh): 32 KB since CUDA 12.1, 4 KB before.
VARIANTS = {"param32k": 12080, "param4k": 12000}


def rewrite(source: str) -> str:
    return GRID_CONSTANT.sub(r"\1& \2", LAUNCH.sub(r"::emu::launch(\1, \2)(", source))


def build(out_dir: Path, variant: str) -> Path:
    """Returns the path of the emulation library for `variant` (one of VARIANTS), built under out_dir."""
    src = out_dir / "csrc"
    for sub in ("kernels", "cuda"):
        (src / sub).mkdir(parents=True, exist_ok=True)
        for f in sorted((ROOT / "csrc" / sub).iterdir()):
            if f.suffix in (".cuh", ".h", ".cu"):
                (src / sub / (f.name + (".cpp" if f.suffix == ".cu" else ""))).write_text(rewrite(f.read_text()))
    lib = out_dir / f"emu_{variant}.so"
    units = sorted(str(p) for p in (src / "cuda").glob("*.cu.cpp"))
    cmd = [
        os.environ.get("CXX", "g++"),
        "-O2",
        "-std=c++17",
        "-ffp-contract=off",  # as setup.py builds the host element math
        "-fPIC",
        "-shared",
        "-U_FORTIFY_SOURCE",  # the fibers' _longjmp between stacks must not be checked
        "-Wall",
        "-Wextra",
        "-Werror",
        "-Wno-unknown-pragmas",  # #pragma unroll
        f"-DCUDART_VERSION={VARIANTS[variant]}",
        f"-I{HERE / 'shim'}",
        f"-I{src / 'cuda'}",
        *units,
        str(HERE / "emu_ops.cpp"),
        str(HERE / "emu_optim.cpp"),
        "-o",
        str(lib),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return lib
