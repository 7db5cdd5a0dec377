"""Builds gradacc_ext._C: CUDA + CPU kernels, CPU only, or nothing.

Environment switches (see docs/install.md, "Environment variables"):
  GRADACC_NO_EXT=1       pure-Python install; every op runs the PyTorch reference.
  GRADACC_NO_CUDA=1      C++ CPU kernels only, even against a CUDA torch with nvcc found.
  GRADACC_FORCE_CUDA=1   build the CUDA kernels even against a CPU-only torch (needs nvcc only:
                         the CUDA wheel is built that way, on a machine with no GPU).
  CUDA_HOME              the CUDA toolkit; default: where nvcc (on PATH or /usr/local/cuda) lives.
  TORCH_CUDA_ARCH_LIST   GPU architectures; default by CUDA version (DEFAULT_ARCH_LISTS).
  GRADACC_CPU_VARIANTS=0 baseline CPU kernels only (on x86-64 the AVX2 and
                         AVX-512 variants are built too, see csrc/cpu/isa.h).
  MAX_JOBS               parallel compile jobs.

CUDA is chosen from torch.version.cuda and nvcc, never from
torch.cuda.is_available(): wheels must build on machines without a GPU.
The CUDA build links no torch CUDA library and the CUDA runtime statically: it
uses only the LibTorch stable ABI, so a CPU torch's headers and nvcc build it
(csrc/cuda/stream.cpp finds torch's current stream at run time).
"""

import os
import platform
import pprint
import re
import shutil
import subprocess
import warnings
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
# The wheel's default GPU archs, by the CUDA toolkit that builds it (docs/install.md, "GPU architectures"):
# a binary for every major generation the toolkit supports (X.Y runs on X.Z, Z >= Y, so 8.6/8.9
# run the 8.0 binary), plus PTX of the newest for later GPUs. CUDA 13 dropped 7.0; sm_100/sm_120
# need CUDA 12.8, sm_110 CUDA 13.0. Measured cost: about 3 CPU-seconds of nvcc and 0.5 MB each.
DEFAULT_ARCH_LISTS = (
    ((13, 0), "7.5;8.0;9.0;10.0;11.0;12.0+PTX"),
    ((12, 8), "7.0;7.5;8.0;9.0;10.0;12.0+PTX"),
    ((0, 0), "7.0;7.5;8.0;9.0+PTX"),
)
BUILD_CONFIG = ROOT / "gradacc_ext" / "_build_config.py"

# CPU kernel files compiled once per ISA variant; csrc/cpu/isa.h says how a file joins.
CPU_ISA_SOURCES = ["csrc/cpu/kernels_cpu.cpp", "csrc/cpu/optim_cpu.cpp"]
# x86-64 variants beside the baseline, by namespace. ATen's AVX2 / AVX512 CPU capability, which picks the variant
# at runtime (csrc/cpu/isa.cpp), implies every extension named here. No -mfma: -ffp-contract=off forbids
# contraction anyway. AVX512_BF16's conversion flushes subnormals to zero, so it is not used (csrc/cpu/loops_cpu.h).
# The LibTorch stable-ABI version the binary targets (TORCH_TARGET_VERSION: major << 56 | minor << 48), and
# CPython's limited API (abi3: torch's py_limited_api=True defines Py_LIMITED_API for 3.10 and later).
STABLE_TARGET = "2.11"
STABLE_TARGET_HEX = f"0x{(2 << 56) | (11 << 48):016x}"
# manylinux_2_28 (glibc 2.28, torch's own tag) though this machine's glibc is newer: each file pins the glibc
# functions that a part of _C would otherwise take at a newer version (csrc/compat/glibc_pin.h), on x86-64
# glibc only. The CUDA one also needs the pre-2.34 homes of those functions as NEEDED libraries.
GLIBC_PIN_SOURCES = {"cpu": "csrc/compat/glibc_2_28.cpp", "cuda": "csrc/compat/glibc_2_28_cudart.cpp"}
PRE_2_34_LIBRARIES = ["libdl.so.2", "libpthread.so.0", "librt.so.1"]
X86_ISA_FLAGS = {
    "isa_avx2": ["-mavx2", "-mf16c"],
    "isa_avx512": ["-mavx2", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
}


def default_arch_list(cuda_version: str | None) -> str:
    major, minor = (int(x) for x in (cuda_version or "0.0").split(".")[:2])
    return next(archs for since, archs in DEFAULT_ARCH_LISTS if (major, minor) >= since)


def _cuda_home() -> str | None:
    """The CUDA toolkit's root: CUDA_HOME / CUDA_PATH, else the TOP that nvcc itself reports.

    nvcc's --dryrun TOP is right even when nvcc is a wrapper script outside the toolkit (scripts/cuda_home.sh).
    """
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not os.access(nvcc, os.X_OK):
        return None
    dry_run = [nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull]
    dry = subprocess.run(dry_run, capture_output=True, text=True)
    top = re.search(r"^#\$ TOP=(.*)$", dry.stderr + dry.stdout, re.MULTILINE)
    return os.path.realpath(top.group(1)) if top else None


def _nvcc_version(cuda_home: str) -> str:
    out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release (\d+\.\d+)", out)
    if not found:
        raise SystemExit(f"setup.py: cannot read the CUDA version from {cuda_home}/bin/nvcc --version")
    return found.group(1)


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _version(cuda_version: str | None) -> str:
    """gradacc_ext.__version__, with the CUDA variant as a local version (0.1.0+cu130) when CUDA is built in."""
    base = re.search(r'^__version__ = "(.+)"$', (ROOT / "gradacc_ext" / "__init__.py").read_text(), re.MULTILINE)
    if base is None:
        raise SystemExit("setup.py: no __version__ line in gradacc_ext/__init__.py")
    return base.group(1) + ("+cu" + cuda_version.replace(".", "") if cuda_version else "")


def _write_build_config(config: dict) -> None:
    """Records what the extension is built with, readable without loading it."""
    BUILD_CONFIG.write_text(
        '"""Generated by setup.py at build time; do not edit."""\n\nBUILD_CONFIG = ' + pprint.pformat(config) + "\n"
    )


def _isa_variants() -> dict[str, list[str]]:
    """The CPU variants to build besides the baseline: x86-64 only, with a GCC/Clang-style compiler."""
    off = os.environ.get("GRADACC_CPU_VARIANTS", "1").strip().lower() in ("0", "false", "no", "off")
    if off or platform.machine().lower() not in ("x86_64", "amd64") or os.name == "nt":
        return {}
    return X86_ISA_FLAGS


def _pins_glibc() -> bool:
    """Whether this build pins glibc symbol versions (GLIBC_PIN_SOURCES): x86-64 Linux with glibc."""
    x86_64 = platform.machine().lower() in ("x86_64", "amd64")
    return platform.system() == "Linux" and x86_64 and platform.libc_ver()[0] == "glibc"


def _glibc_pin_wraps(sources: list[str]) -> list[str]:
    """-Wl,--wrap=NAME for every GRADACC_PIN_GLIBC(NAME, ...) in the given pin sources."""
    pin = re.compile(r"^GRADACC_PIN_GLIBC\((\w+),", re.MULTILINE)
    names = [name for src in sources for name in pin.findall((ROOT / src).read_text())]
    return [f"-Wl,--wrap={name}" for name in names]


def _with_isa_variants(build_ext_class: type, variants: dict[str, list[str]]) -> type:
    """build_ext that also compiles CPU_ISA_SOURCES once per variant and links those objects after the baseline's.

    The baseline objects come first on the link line, so for an inline function compiled in several variants
    the linker keeps the baseline copy, which every CPU can run.
    """

    class IsaBuildExtension(build_ext_class):
        def build_extension(self, ext) -> None:
            objects = []
            for namespace, flags in variants.items():
                extra = [*flags, f"-DGRADACC_CPU_ISA={namespace}"]
                args = ext.extra_compile_args
                args = {**args, "cxx": args["cxx"] + extra} if isinstance(args, dict) else args + extra
                objects += self.compiler.compile(
                    CPU_ISA_SOURCES,
                    output_dir=os.path.join(self.build_temp, namespace),
                    include_dirs=ext.include_dirs,
                    extra_postargs=args,
                    depends=ext.depends,
                )
            ext.extra_objects = [*ext.extra_objects, *objects]
            super().build_extension(ext)

    return IsaBuildExtension


def _extensions():
    if _flag("GRADACC_NO_EXT"):
        _write_build_config({"extension": False, "torch_version": None, "cuda_version": None, "arch_list": None})
        return [], {}, None

    # torch warns at import when numpy is missing (a fresh venv builds before the `test` extra brings it);
    # the build never uses numpy, so the warning is only noise in the build log.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch
    from torch.utils import cpp_extension
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    if _flag("GRADACC_NO_CUDA") and _flag("GRADACC_FORCE_CUDA"):
        raise SystemExit("setup.py: GRADACC_NO_CUDA=1 and GRADACC_FORCE_CUDA=1 contradict each other; set one")
    wanted = not _flag("GRADACC_NO_CUDA") and (_flag("GRADACC_FORCE_CUDA") or torch.version.cuda is not None)
    cuda_home = _cuda_home() if wanted else None
    if _flag("GRADACC_FORCE_CUDA") and cuda_home is None:
        raise SystemExit("setup.py: GRADACC_FORCE_CUDA=1 but no CUDA toolkit found; put nvcc on PATH or set CUDA_HOME")
    use_cuda = cuda_home is not None
    # The toolkit's version, not torch's: its runtime is linked in statically, and it picks the default archs.
    cuda_version = _nvcc_version(cuda_home) if use_cuda else None
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST") or default_arch_list(cuda_version)
    torch_version = torch.__version__.split("+")[0]

    variants = _isa_variants()
    sources = ["csrc/module.cpp", "csrc/ops.cpp", "csrc/stable.cpp", "csrc/binding.cpp", "csrc/cpu/isa.cpp"]
    sources += ["csrc/aliasing.cpp"]  # the memory check of every op's arguments (csrc/aliasing.h)
    sources += ["csrc/requires_grad.cpp"]  # the public ops' leaf check in one C pass (csrc/requires_grad.h)
    sources += ["csrc/handles.cpp"]  # the Tensor[] items' handles, deleted under one GIL hold (csrc/handles.h)
    sources += CPU_ISA_SOURCES
    sources += ["csrc/binding_optim.cpp"]  # the fused optimizer steps (their CPU kernel is in CPU_ISA_SOURCES)
    define = [
        f'-DGRADACC_TORCH_VERSION="{torch_version}"',
        f'-DGRADACC_CUDA_VERSION="{cuda_version or ""}"',
        f'-DGRADACC_ARCH_LIST="{arch_list if use_cuda else ""}"',
        # LibTorch stable ABI only, as torch 2.11 offers it: the binary loads in every torch from 2.11 on
        # (issue 22). The headers are the building torch's; anything newer than 2.11 fails to compile.
        f"-DTORCH_TARGET_VERSION={STABLE_TARGET_HEX}",
    ]
    # -ffp-contract=off: the element math must not be fused into FMAs on the
    # host either, so CPU results match the CUDA kernels bit for bit.
    # -fno-math-errno: sqrt (the AdamW step's) may then vectorise; IEEE sqrt is exact either way.
    cxx = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-math-errno", *define]
    # torch::stable::parallel_for runs the CPU kernels' loops inside libtorch, on torch's own thread pool:
    # no -fopenmp here.
    if variants:
        cxx.append("-DGRADACC_CPU_X86_VARIANTS")
    cuda = {}
    pins = [GLIBC_PIN_SOURCES["cpu"], *([GLIBC_PIN_SOURCES["cuda"]] if use_cuda else [])] if _pins_glibc() else []
    sources += pins
    link = _glibc_pin_wraps(pins)
    if use_cuda:
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
        # BuildExtension compiles .cu files with the nvcc under cpp_extension.CUDA_HOME, which a CPU torch leaves None.
        cpp_extension.CUDA_HOME = cuda_home
        sources += [
            "csrc/cuda/kernels.cu",
            "csrc/cuda/register_cuda.cpp",
            "csrc/cuda/optim_kernels.cu",
            "csrc/cuda/register_optim_cuda.cpp",
            "csrc/cuda/stream.cpp",
        ]
        cxx += ["-DGRADACC_WITH_CUDA", "-DUSE_CUDA"]
        cuda = {
            "include_dirs": [os.path.join(cuda_home, "include")],
            "library_dirs": [os.path.join(cuda_home, "lib64")],
            # The CUDA runtime linked in (no libcudart.so to find at run time).
            # dl for the stream lookup and the runtime, rt and pthread for the runtime.
            "libraries": ["cudart_static"] + ([] if pins else ["dl", "rt", "pthread"]),
        }
        if pins:  # glibc >= 2.34 has them in libc (and stubs); the pinned versions live in these files before.
            needed = [f"-l:{lib}" for lib in PRE_2_34_LIBRARIES]
            link += ["-Wl,--push-state,--no-as-needed", *needed, "-Wl,--pop-state"]
    nvcc = ["-O3", "-std=c++17", "-DGRADACC_WITH_CUDA", *define]
    ext = CppExtension(
        "gradacc_ext._C",
        sources,
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        extra_link_args=link,
        py_limited_api=True,
        **cuda,
    )

    _write_build_config(
        {
            "extension": True,
            "torch_version": torch_version,
            "cuda_version": cuda_version,
            "arch_list": arch_list if use_cuda else None,
            "cpu_isas": ["default", *(name.removeprefix("isa_") for name in variants)],
            "abi": "stable",
            "min_torch_version": STABLE_TARGET,
        }
    )
    return [ext], {"build_ext": _with_isa_variants(BuildExtension, variants)}, cuda_version


ext_modules, cmdclass, built_cuda = _extensions()
# One wheel for CPython 3.10 and later: the extension uses only the limited API (cp310-abi3).
options = {"bdist_wheel": {"py_limited_api": "cp310"}} if ext_modules else {}
setup(version=_version(built_cuda), ext_modules=ext_modules, cmdclass=cmdclass, options=options)
