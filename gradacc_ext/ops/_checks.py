"""Argument checks for the pure-PyTorch backend.

They mirror csrc/binding.cpp rule for rule (same exception types, messages
that name the argument), so both backends reject bad input identically and
write nothing when they do. Each op's own sequence of them is its record's:
core_args.py (check()) for the core ops, _checks_optim.py for the optimizer steps.
"""

from __future__ import annotations

import enum
import itertools
import math
import operator
from collections.abc import Sequence

import torch

from .constants import FLOAT_DTYPES

SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)
FLOAT32_MAX = torch.finfo(torch.float32).max
# The single-list ops (norms, clips: computed in double) and the optimizer steps also take float64.
SINGLE_LIST = FLOAT_DTYPES
SCALAR_FLOATS = SINGLE_LIST


def num(value: float) -> str:
    """A number as C++'s ostream prints it (6 significant digits, %g), so messages match the binding's."""
    return f"{value:g}"


def check_defined(op: str, arg: str, tensors: Sequence[torch.Tensor | None]) -> None:
    """None in a list: checked in Python before either backend runs, because the compiled ops' schema
    (Tensor[]) would reject it with torch's own message before the binding could name it. One C-level pass
    (identity with None) first: this runs on every call of the public ops."""
    if not any(map(operator.is_, tensors, itertools.repeat(None))):
        return
    for i, t in enumerate(tensors):
        if t is None:
            raise ValueError(f"{op}: {arg}[{i}] is undefined (None)")


def list_device(tensors: Sequence[torch.Tensor], fallback: torch.Tensor | None = None) -> torch.device:
    for t in tensors:
        if t is not None:
            return t.device
    return fallback.device if fallback is not None else torch.device("cpu")


def is_dense(t: torch.Tensor) -> bool:
    """c10's is_non_overlapping_and_dense, which Python does not expose: the dims of size >= 2, ordered by
    stride, have exactly a contiguous tensor's strides (so the elements fill one block of memory).
    Callers try t.is_contiguous() first: it is a C call, and a contiguous tensor is always dense."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz >= 2):
        if stride != expected:
            return False
        expected *= size
    return True


class Use(enum.Enum):
    """Which tensors a list accepts, csrc/binding.h's Use. PAIRED (accumulate, unscale_): contiguous
    fp32/fp16/bf16, as the accumulate ops pair two lists element by element. SINGLE_LIST (norms, clips):
    float64 too (computed in double), and any dense non-overlapping tensor (channels_last, any
    permutation), visited in storage order. STEP (the fused optimizer steps): contiguous, float64 too.
    STEP_STATE (their state lists): STEP's and uint8 (int8 state codes)."""

    PAIRED = "paired"
    SINGLE_LIST = "single_list"
    STEP = "step"
    STEP_STATE = "step_state"


_DTYPES = {  # what each Use accepts, and how its message says it
    Use.PAIRED: (SUPPORTED, "float32, float16 or bfloat16"),
    Use.SINGLE_LIST: (SINGLE_LIST, "float32, float16, bfloat16 or float64"),
    Use.STEP: (SINGLE_LIST, "float32, float16, bfloat16 or float64"),
    Use.STEP_STATE: ((*SINGLE_LIST, torch.uint8), "float32, float16, bfloat16, float64 or uint8"),
}


def check_tensor(op: str, arg: str, i: int, t: torch.Tensor | None, device: torch.device, use: Use) -> None:
    """One tensor of a list argument, `arg`[i], that the kernels read or write as one flat block on `device`."""
    dtypes, names = _DTYPES[use]
    if t is None:
        raise ValueError(f"{op}: {arg}[{i}] is undefined (None)")
    if t.layout != torch.strided:
        raise ValueError(f"{op}: {arg}[{i}] has layout {t.layout}; expected a dense (strided) tensor")
    if t.device != device:
        raise ValueError(
            f"{op}: {arg}[{i}] is on {t.device} but the tensors are on {device}; all tensors must be on one device"
        )
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: {arg}[{i}] has dtype {t.dtype}; expected {names}")
    if use is Use.SINGLE_LIST:
        if not (t.is_contiguous() or is_dense(t)):
            raise ValueError(
                f"{op}: {arg}[{i}] is not dense (sizes {list(t.shape)}, strides {list(t.stride())}); "
                "expected a dense non-overlapping tensor, such as a contiguous or channels_last one"
            )
    elif not t.is_contiguous():
        raise ValueError(
            f"{op}: {arg}[{i}] is not contiguous (sizes {list(t.shape)}, strides {list(t.stride())}); "
            "expected a contiguous tensor"
        )


def check_list(op: str, arg: str, tensors: Sequence[torch.Tensor], device: torch.device, use: Use = Use.PAIRED) -> None:
    for i, t in enumerate(tensors):
        check_tensor(op, arg, i, t, device, use)


def check_same_shape(op: str, arg: str, i: int, t: torch.Tensor, ref_arg: str, ref: torch.Tensor) -> None:
    """`arg`[i] pairs element by element with `ref_arg`[i]."""
    if t.shape != ref.shape:
        raise ValueError(
            f"{op}: {arg}[{i}] has shape {list(t.shape)} but {ref_arg}[{i}] has shape {list(ref.shape)}; "
            "expected equal shapes"
        )


def check_pair_dtype(
    ok: bool, op: str, arg: str, i: int, t: torch.Tensor, ref_arg: str, ref: torch.Tensor, expected: str
) -> None:
    """`ok`: whether `arg`[i]'s dtype goes with `ref_arg`[i]'s; `expected` says which would."""
    if not ok:
        raise TypeError(
            f"{op}: {arg}[{i}] has dtype {t.dtype} but {ref_arg}[{i}] has dtype {ref.dtype}; expected {expected}"
        )


def check_scalar(op: str, arg: str, t: torch.Tensor | None, device: torch.device) -> None:
    if t is None:
        raise ValueError(f"{op}: {arg} is undefined (None)")
    if t.dtype != torch.float32:
        raise TypeError(f"{op}: {arg} has dtype {t.dtype}; expected a one-element float32 tensor")
    if t.layout != torch.strided or t.numel() != 1:
        raise ValueError(f"{op}: {arg} has {t.numel()} elements; expected a one-element float32 tensor")
    if t.device != device:
        raise ValueError(
            f"{op}: {arg} is on {t.device} but the tensors are on {device}; expected it on the same device"
        )


def check_fast_norm_type(op: str, norm_type: float) -> None:
    """The accumulate final step's partial norm adds across calls: L2 (sum of squares) or inf (max) only."""
    if not (norm_type == 2.0 or norm_type == math.inf):
        raise ValueError(f"{op}: norm_type must be 2.0 or inf, got {num(norm_type)}")


def check_norm_type(op: str, norm_type: float) -> None:
    if math.isnan(norm_type):
        raise ValueError(f"{op}: norm_type must be a number or +-inf, got {num(norm_type)}")


def check_norm_scalar(op: str, total_norm: torch.Tensor | None, device: torch.device) -> None:
    """A clip's total_norm: one element of any float dtype (torch's get_total_norm returns the grads' dtype)."""
    if total_norm is None:
        raise ValueError(f"{op}: total_norm is undefined (None)")
    if total_norm.dtype not in SCALAR_FLOATS:
        raise TypeError(f"{op}: total_norm has dtype {total_norm.dtype}; expected a one-element floating-point tensor")
    if total_norm.layout != torch.strided or total_norm.numel() != 1:
        raise ValueError(
            f"{op}: total_norm has {total_norm.numel()} elements; expected a one-element floating-point tensor"
        )
    if total_norm.device != device:
        raise ValueError(
            f"{op}: total_norm is on {total_norm.device} but the tensors are on {device}; "
            "expected it on the same device"
        )


def check_fits_float(op: str, arg: str, value: float, tensors: Sequence[torch.Tensor] = ()) -> None:
    """The kernels compute in float32: a finite value beyond its range would become inf silently
    (eps=1e39 zeroes every grad). Inf and NaN pass; the op's own checks decide about them. A list
    of float64 `tensors` only (the clip ops) uses the value in double: any value is fine then."""
    if tensors and all(t.dtype == torch.float64 for t in tensors):
        return
    if math.isfinite(value) and abs(value) > FLOAT32_MAX:
        raise ValueError(
            f"{op}: {arg} = {num(value)} does not fit in float32, the kernels' type; "
            f"expected |{arg}| <= {num(FLOAT32_MAX)}"
        )


def check_max_norm(op: str, max_norm: float) -> None:
    """inf measures without clipping and 0 zeroes the tensors, as in torch; NaN and negatives are refused."""
    if not max_norm >= 0:
        raise ValueError(f"{op}: max_norm must be >= 0 (inf allowed), got {num(max_norm)}")
