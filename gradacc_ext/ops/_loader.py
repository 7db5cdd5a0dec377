"""Loads the compiled extension gradacc_ext._C, or explains why it is absent.

The build records what it was built with in _build_config.py (written by
setup.py). The binary uses only the LibTorch stable ABI of torch
``min_torch_version`` (2.11), so it loads in that torch and every later one;
an older torch is reported in words before the binary is loaded, instead of
surfacing as an undefined-symbol trace.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from typing import Any

import torch
from torch.torch_version import TorchVersion

from ._native import NativeExtension

REQUIRE_ENV = "GRADACC_REQUIRE_EXT"
DISABLE_ENV = "GRADACC_NO_EXT"


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _recorded_config() -> dict[str, Any] | None:
    try:
        from .._build_config import BUILD_CONFIG
    except ImportError:
        return None
    return dict(BUILD_CONFIG)


def running_torch_version() -> str:
    return torch.__version__.split("+")[0]


def runs_with(torch_version: str, minimum: str | None) -> bool:
    """Whether a stable-ABI build for torch >= `minimum` loads in `torch_version`."""
    return TorchVersion(torch_version.split("+")[0]) >= (minimum or "2.11")


def _load() -> tuple[NativeExtension | None, dict[str, Any] | None, str]:
    """Returns (module or None, recorded build config, reason for the state)."""
    config = _recorded_config()
    if _flag(DISABLE_ENV):
        return None, config, f"{DISABLE_ENV}=1 is set"
    if config is None:
        return None, None, "gradacc_ext was not built (no _build_config.py)"
    if not config.get("extension"):
        return None, config, "gradacc_ext was installed without its extension (GRADACC_NO_EXT=1 at build time)"
    minimum, running = config.get("min_torch_version") or "2.11", running_torch_version()
    if not runs_with(running, minimum):
        return (
            None,
            config,
            f"gradacc_ext._C uses the LibTorch stable ABI of torch >= {minimum} but torch {running} is running; "
            f"upgrade torch to {minimum} or later",
        )
    try:
        module = NativeExtension(importlib.import_module("gradacc_ext._C"))
    except (ImportError, OSError, RuntimeError) as exc:
        rebuild = "rebuild with `pip install --no-build-isolation -e .`"
        return None, config, f"gradacc_ext._C failed to load ({exc}); {rebuild}"
    return module, config, "compiled extension loaded"


_C, BUILD_CONFIG, LOAD_REASON = _load()

if _C is None and BUILD_CONFIG is not None and BUILD_CONFIG.get("extension") and not _flag(DISABLE_ENV):
    if _flag(REQUIRE_ENV):
        raise ImportError(LOAD_REASON)
    warnings.warn(LOAD_REASON + " (falling back to the pure-PyTorch reference)", RuntimeWarning, stacklevel=2)
elif _C is None and _flag(REQUIRE_ENV):
    raise ImportError(f"{REQUIRE_ENV}=1 but {LOAD_REASON}")


def extension_loaded() -> bool:
    return _C is not None


@functools.cache
def extension_has_cuda() -> bool:
    """Whether the build holds CUDA kernels. Fixed for the process, and asked on every CUDA op call
    (resolve_backend): read once, not one dispatcher call and JSON parse per op."""
    return _C is not None and bool(_C.compiled_info()["with_cuda"])


def build_info() -> dict[str, Any]:
    """What the extension was built with, next to what is running now."""
    compiled = _C.compiled_info() if _C is not None else None
    return {
        "extension_loaded": _C is not None,
        "reason": LOAD_REASON,
        "built_torch_version": (BUILD_CONFIG or {}).get("torch_version"),
        "built_cuda_version": (BUILD_CONFIG or {}).get("cuda_version"),
        # The binary's ABI ("stable": LibTorch stable ABI) and the oldest torch it loads in.
        "abi": (BUILD_CONFIG or {}).get("abi"),
        "min_torch_version": (BUILD_CONFIG or {}).get("min_torch_version"),
        "arch_list": (BUILD_CONFIG or {}).get("arch_list"),
        "with_cuda": bool(compiled and compiled["with_cuda"]),
        # A CUDA build finds torch's current stream in the loaded libtorch_cuda ("ok"), else says why not.
        "cuda_stream": compiled.get("cuda_stream") if compiled else None,
        # CPU kernel variants in the binary and the one in use (csrc/cpu/isa.h)
        "cpu_isas": list(compiled.get("cpu_isas", [])) if compiled else [],
        "cpu_isa": _C.cpu_isa() if compiled and "cpu_isas" in compiled else None,
        "running_torch_version": torch.__version__,
        "running_cuda_version": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
