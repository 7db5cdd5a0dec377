"""ctypes front end of the emulated CUDA launchers (emu_ops.cpp): torch CPU tensors in, the device code run."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from pathlib import Path

import torch

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}  # gradacc::DType
SCALE_MODES = {"unscale": 0, "clip_norm": 1, "clip_value": 2}  # gradacc::ScaleMode
_FLOAT_P = ctypes.POINTER(ctypes.c_float)


class _Span(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("numel", ctypes.c_int64), ("dtype", ctypes.c_int32)]


def _spans(tensors: Sequence[torch.Tensor]) -> ctypes.Array:
    return (_Span * max(len(tensors), 1))(*[_Span(t.data_ptr(), t.numel(), DTYPE_CODES[t.dtype]) for t in tensors])


def _ptr(t: torch.Tensor | None) -> ctypes._Pointer | None:
    if t is None:
        return None
    assert t.dtype == torch.float32 and t.device.type == "cpu"
    return ctypes.cast(t.data_ptr(), _FLOAT_P)


def _norm_kind(norm_type: float) -> int:
    """gradacc::NormKind of an order, as csrc/binding.cpp maps it."""
    special = {2.0: 0, math.inf: 1, -math.inf: 2, 0.0: 3, 1.0: 4}
    return special.get(norm_type, 5)


class Emulator:
    """The launchers of csrc/cuda/kernels.cu, run on the host by the shim (evidence, not GPU verification)."""

    def __init__(self, lib: Path) -> None:
        self.lib = ctypes.CDLL(str(lib))
        self.lib.emu_accumulate.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, _FLOAT_P, ctypes.c_int, ctypes.c_int,
            _FLOAT_P, _FLOAT_P, _FLOAT_P, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t,
        ]  # fmt: skip
        self.lib.emu_norm.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double, _FLOAT_P, _FLOAT_P, ctypes.c_char_p,
            ctypes.c_size_t,
        ]  # fmt: skip
        self.lib.emu_scale.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, _FLOAT_P, _FLOAT_P, _FLOAT_P, ctypes.c_float,
            ctypes.c_float, ctypes.c_float, ctypes.c_char_p, ctypes.c_size_t,
        ]  # fmt: skip

    def capacity(self, depth: int) -> int:
        """Tensors per launch of ListMeta<depth> in this build."""
        return int(self.lib.emu_meta_capacity(depth))

    def _call(self, fn, *args) -> None:
        err = ctypes.create_string_buffer(1024)
        rc = fn(*args, err, len(err))
        if rc != 0:
            raise RuntimeError(f"emulated launch failed ({rc}): {err.value.decode()}")

    def accumulate_(self, bufs, grads, alpha: float, alpha_tensor=None, assign=False, final=None) -> None:
        """final: None, or (inv_scale or None, found_inf, norm_out, norm_type) for the final step."""
        inv_scale, found_inf, norm_out, norm_type = final or (None, None, None, 2.0)
        self._call(
            self.lib.emu_accumulate, _spans(bufs), _spans(grads), len(bufs), alpha, _ptr(alpha_tensor), int(assign),
            int(final is not None), _ptr(inv_scale), _ptr(found_inf), _ptr(norm_out), _norm_kind(norm_type),
        )  # fmt: skip

    def global_norm(self, tensors, norm_type: float, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
        total = torch.full((), math.nan)  # poisoned: the kernels must write both outputs
        each = torch.full((len(tensors) if per_tensor else 0,), math.nan)
        self._call(
            self.lib.emu_norm, _spans(tensors), len(tensors), _norm_kind(norm_type), norm_type, _ptr(total),
            _ptr(each) if per_tensor else None,
        )  # fmt: skip
        return total, each

    def scale_(self, tensors, mode: str, *, inv_scale=None, found_inf=None, total_norm=None, max_norm=0.0,
               eps=0.0, clip_value=0.0) -> None:  # fmt: skip
        self._call(
            self.lib.emu_scale, _spans(tensors), len(tensors), SCALE_MODES[mode], _ptr(inv_scale), _ptr(found_inf),
            _ptr(total_norm), max_norm, eps, clip_value,
        )  # fmt: skip
