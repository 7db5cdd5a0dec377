"""The compiled extension's Python face, on the LibTorch stable ABI.

``gradacc_ext._C`` is a limited-API module: importing it loads the library, whose
static initialisers register every op with ``torch.ops.gradacc``; its one Python function is the
public ops' requires_grad pass (``ops/_aliasing.py``, csrc/requires_grad.h). Its build facts and the CPU
kernel-variant controls are stable ops too (csrc/ops.cpp); this wraps them in the functions
the package and the tests call, and hands in the one thing the stable ABI cannot query,
``torch.backends.cpu.get_cpu_capability()`` (which honours ``ATEN_CPU_CAPABILITY``).
"""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import torch

# The ops without tensor arguments: the build's facts and the CPU variant controls, not kernels.
INFO_OPS = frozenset({"compiled_info", "cpu_isa", "supported_cpu_isa", "set_cpu_isa", "init_cpu_isa"})


class NativeExtension:
    """The loaded ``_C`` module and its stable ops (compiled_info, cpu_isa, set_cpu_isa)."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.__file__ = module.__file__
        torch.ops.gradacc.init_cpu_isa(torch.backends.cpu.get_cpu_capability())

    def compiled_info(self) -> dict[str, Any]:
        return json.loads(torch.ops.gradacc.compiled_info())

    def cpu_isa(self) -> str:
        return torch.ops.gradacc.cpu_isa()

    def supported_cpu_isa(self) -> str:
        return torch.ops.gradacc.supported_cpu_isa()

    def set_cpu_isa(self, name: str) -> None:
        """Picks the CPU variant by name; ValueError (the stable ABI's RuntimeError, same message) if not allowed."""
        try:
            torch.ops.gradacc.set_cpu_isa(name)
        except RuntimeError as exc:
            raise ValueError(str(exc).splitlines()[0]) from None
