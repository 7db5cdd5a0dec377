"""ctypes front end of the emulated CUDA launchers (emu_ops.cpp, emu_optim.cpp): torch CPU tensors in, the
device code run. The optimizer steps take the ops' argument records (gradacc_ext.ops.optim_args), so one
record serves the emulation, the CPU kernels and the float64 reference."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from gradacc_ext.ops.optim_args import OptimStep

# gradacc::DType (uint8: the int8 states' codes)
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3, torch.uint8: 4}
STORAGES = {"fp32": 0, "bf16": 1, "int8": 2}  # gradacc::StateStorage
SCALE_MODES = {"unscale": 0, "clip_norm": 1, "clip_value": 2}  # gradacc::ScaleMode
STATE_SLOTS = 3  # gradacc::kMaxStateSlots
_FLOAT_P = ctypes.POINTER(ctypes.c_float)
_VOID_P = ctypes.c_void_p


class _Span(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("numel", ctypes.c_int64), ("dtype", ctypes.c_int32)]


def _spans(tensors: Sequence[torch.Tensor]) -> ctypes.Array:
    return (_Span * max(len(tensors), 1))(*[_Span(t.data_ptr(), t.numel(), DTYPE_CODES[t.dtype]) for t in tensors])


def _any_ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


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
            _FLOAT_P, _FLOAT_P, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t,
        ]  # fmt: skip
        self.lib.emu_norm.argtypes = [
            _VOID_P, ctypes.c_int64, ctypes.c_int, ctypes.c_double, ctypes.c_int, _VOID_P, _VOID_P, ctypes.c_char_p,
            ctypes.c_size_t,
        ]  # fmt: skip
        self.lib.emu_scale.argtypes = [
            _VOID_P, ctypes.c_int64, ctypes.c_int, _FLOAT_P, _FLOAT_P, _VOID_P, ctypes.c_int, ctypes.c_double,
            ctypes.c_double, ctypes.c_double, ctypes.c_char_p, ctypes.c_size_t,
        ]  # fmt: skip
        self.lib.emu_optim_step.argtypes = [
            ctypes.c_char_p, _VOID_P, _VOID_P, _VOID_P, ctypes.c_int64, ctypes.c_double, _VOID_P, ctypes.c_int,
            ctypes.c_int, _FLOAT_P, _FLOAT_P, _FLOAT_P, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_char_p,
            ctypes.c_size_t,
        ]  # fmt: skip

    def capacity(self, depth: int) -> int:
        """Tensors per launch of ListMeta<depth> in this build (depth 7: the optimizer steps, 10: with int8
        states, whose metadata adds the scales lists)."""
        optim = {7: self.lib.emu_optim_capacity, 10: self.lib.emu_quant_optim_capacity}
        return int(optim[depth]() if depth in optim else self.lib.emu_meta_capacity(depth))

    def step_batch(self) -> int:
        """Step counts per launch of the optimizer steps' increment kernel in this build."""
        return int(self.lib.emu_step_batch())

    def _call(self, fn, *args) -> None:
        err = ctypes.create_string_buffer(1024)
        rc = fn(*args, err, len(err))
        if rc != 0:
            raise RuntimeError(f"emulated launch failed ({rc}): {err.value.decode()}")

    def accumulate_(self, bufs, grads, alpha: float, alpha_tensor=None, assign=False, final=None) -> None:
        """final: None, or (found_inf, norm_acc, norm_type) for a bucket of the last fold (adds into norm_acc)."""
        found_inf, norm_acc, norm_type = final or (None, None, 2.0)
        self._call(
            self.lib.emu_accumulate, _spans(bufs), _spans(grads), len(bufs), alpha, _ptr(alpha_tensor), int(assign),
            int(final is not None), _ptr(found_inf), _ptr(norm_acc), _norm_kind(norm_type),
        )  # fmt: skip

    def global_norm(self, tensors, norm_type: float, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """As the binding: a list holding float64 accumulates in double and returns float64 norms."""
        wide = any(t.dtype == torch.float64 for t in tensors)
        out = torch.float64 if wide else torch.float32
        total = torch.full((), math.nan, dtype=out)  # poisoned: the kernels must write both outputs
        each = torch.full((len(tensors) if per_tensor else 0,), math.nan, dtype=out)
        self._call(
            self.lib.emu_norm, _spans(tensors), len(tensors), _norm_kind(norm_type), norm_type, int(wide),
            total.data_ptr(), each.data_ptr() if per_tensor else None,
        )  # fmt: skip
        return total, each

    def scale_(self, tensors, mode: str, *, inv_scale=None, found_inf=None, total_norm=None, max_norm=0.0,
               eps=0.0, clip_value=0.0) -> None:  # fmt: skip
        """total_norm: a one-element tensor of any float dtype (clip_norm)."""
        norm_dtype = DTYPE_CODES[total_norm.dtype] if total_norm is not None else 0
        self._call(
            self.lib.emu_scale, _spans(tensors), len(tensors), SCALE_MODES[mode], _ptr(inv_scale), _ptr(found_inf),
            _any_ptr(total_norm), norm_dtype, max_norm, eps, clip_value,
        )  # fmt: skip

    def step(self, a: OptimStep) -> None:
        """One optimizer step from its argument record (gradacc_ext.ops.optim_args): any optimizer."""
        state, scales = a.state(), a.scales()
        pad = [[]] * (STATE_SLOTS - len(state))
        lists = [a.params, a.grads, *state, *pad, a.master_params, *scales, *pad]
        span_arrays = [_spans(list(x)) for x in lists]  # kept alive through the call
        heads = (_VOID_P * len(lists))(*[ctypes.addressof(arr) for arr in span_arrays])
        lengths = (ctypes.c_int64 * len(lists))(*[len(x) for x in lists])
        step_ptrs = (_VOID_P * max(len(a.steps), 1))(*[s.data_ptr() for s in a.steps])
        options = a.options()
        self._call(
            self.lib.emu_optim_step, a.NAME.encode(), heads, lengths, step_ptrs, len(a.steps), a.lr,
            (ctypes.c_double * len(options))(*options), len(options), int(a.maximize), _ptr(a.lr_tensor),
            _ptr(a.grad_mult), _ptr(a.found_inf), a.param_mode, a.seed, STORAGES[a.storage()],
        )  # fmt: skip
