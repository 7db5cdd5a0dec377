"""torch.nn.utils' gradient clipping on the fused ops (gradacc_ext.ops).

Every function takes torch's arguments and returns, warns and raises what torch does. The grads the
fused ops serve (fp32, fp16, bf16 and float64, the latter computed in double; contiguous or dense in
another memory order, such as channels_last; on a device with compiled kernels) run as one fused pass
per device, in place. Any other grad (a sliced view, a device without kernels) goes through torch's own
arithmetic, and the two parts combine as torch combines per-tensor norms. A call with nothing to fuse
is torch's own function.

Differences from torch, by design (docs/migration.md, "Drop-in clipping"): the norm is accumulated in fp32 over a
whole device's list and rounded to the result dtype once, and the clip coefficient is computed in fp32
from that fp32 norm; torch rounds both to fp16/bf16 for 16-bit grads. Both are more accurate. `foreach`
selects torch's implementation for the grads torch handles; the fused path is the same for every value.
"""

from __future__ import annotations

import functools
import math
import types
import warnings
from collections.abc import Iterable

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from ..ops import api, is_dense
from ..ops.constants import DEFAULT_EPS, FLOAT_DTYPES
from ..ops.norms import combine_norms

TensorOrTensors = torch.Tensor | Iterable[torch.Tensor]


def _as_list(tensors: TensorOrTensors) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


@functools.cache
def _has_kernels(device: torch.device) -> bool:
    return api.resolve_backend(device)[0] == "ext"


def _split(tensors: list[torch.Tensor]) -> tuple[dict[torch.device, list[torch.Tensor]], list[torch.Tensor]]:
    """(the fusable tensors by device, the rest). torch's C++ grouping helper (the one its clipping uses)
    sorts by device and dtype at C speed; per tensor only the layout is checked in Python."""
    fused: dict[torch.device, list[torch.Tensor]] = {}
    rest: list[torch.Tensor] = []
    for (device, dtype), ([group], _) in _group_tensors_by_device_and_dtype([tensors]).items():
        if dtype not in FLOAT_DTYPES or not _has_kernels(device):
            rest += group
            continue
        for t in group:
            dense = t.layout == torch.strided and (t.is_contiguous() or is_dense(t))
            (fused.setdefault(device, []) if dense else rest).append(t)
    return fused, rest


def _norms(tensors: list[torch.Tensor], norm_type: float, foreach: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the total norm as torch returns it, the same norm in fp32 or better, for the clip coefficient)."""
    if not tensors:
        zero = torch.tensor(0.0)
        return zero, zero
    fused, rest = _split(tensors)
    # torch refuses the +-inf norm of an empty tensor (no identity); its own function raises its own error.
    if not fused or (math.isinf(norm_type) and any(t.numel() == 0 for t in tensors)):
        total = torch.nn.utils.get_total_norm(tensors, norm_type, False, foreach)
        return total, total
    first = tensors[0].device
    result_dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    # torch takes the norm of the per-tensor norms. For p != 0 that equals the norm of everything at
    # once (one fused pass); for p = 0 it counts the tensors that have a nonzero, so it needs them all.
    per_tensor = norm_type == 0.0
    parts = []
    for group in fused.values():
        out = api.global_norm(group, norm_type, per_tensor=per_tensor)
        parts.append(out[1] if per_tensor else out.reshape(1))
    if len(parts) == 1 and not rest and not per_tensor:
        precise = parts[0].reshape(()).to(first)
    else:
        parts += [torch.linalg.vector_norm(t, norm_type).reshape(1) for t in rest]
        dtype = functools.reduce(torch.promote_types, (p.dtype for p in parts), torch.float32)
        precise = combine_norms([p.to(first, dtype) for p in parts], norm_type)
    return precise.to(result_dtype), precise


def _raise_if_nonfinite(total: torch.Tensor, norm_type: float) -> None:
    # The one host synchronisation of error_if_nonfinite=True, as in torch.
    if torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from "
            "`parameters` is non-finite, so it cannot be clipped. To disable "
            "this error and scale the gradients by the non-finite norm anyway, "
            "set `error_if_nonfinite=False`"
        )


def _clip(
    params: list[torch.Tensor], grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor,
    foreach: bool | None,
) -> None:
    """grads *= min(1, max_norm / (total_norm + 1e-6)); `params` own the grads (torch's path reads .grad)."""
    fused, rest = _split(grads)
    plain = isinstance(total_norm, torch.Tensor) and total_norm.is_floating_point() and total_norm.numel() == 1
    # A negative or NaN max_norm is not an op argument; torch's arithmetic gives its (odd) result.
    if not fused or not plain or not max_norm >= 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm, foreach)
        return
    for device, group in fused.items():
        api.clip_by_norm_(group, total_norm.to(device, non_blocking=True), max_norm, DEFAULT_EPS)
    if rest:
        coef = torch.clamp(max_norm / (total_norm + DEFAULT_EPS), max=1.0)
        for g in rest:
            g.mul_(coef.to(g.device))


@torch.no_grad()
def get_total_norm(
    tensors: TensorOrTensors,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """torch.nn.utils.get_total_norm: the norm of the tensors' norms, as one vector.

    Returns a 0-d tensor of the tensors' promoted dtype on the first tensor's device (float32 CPU
    ``tensor(0.)`` for no tensors). error_if_nonfinite=True costs one host synchronisation, as in torch.
    """
    norm_type = float(norm_type)
    total, _ = _norms(_as_list(tensors), norm_type, foreach)
    if error_if_nonfinite:
        _raise_if_nonfinite(total, norm_type)
    return total


@torch.no_grad()
def clip_grads_with_norm_(
    parameters: TensorOrTensors,
    max_norm: float,
    total_norm: torch.Tensor,
    foreach: bool | None = None,
) -> None:
    """torch.nn.utils.clip_grads_with_norm_: grads *= min(1, max_norm / (total_norm + 1e-6)), in place.

    total_norm is a tensor of any float dtype, on any device (as in torch). max_norm=inf leaves the grads
    unchanged, max_norm=0 zeroes them. No host synchronisation.
    """
    params = _as_list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    max_norm = float(max_norm)
    if grads:
        _clip(params, grads, max_norm, total_norm, foreach)


@torch.no_grad()
def clip_grad_norm_(
    parameters: TensorOrTensors,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_: get_total_norm of the grads, then clip_grads_with_norm_ by it.

    Returns the pre-clip total norm (see get_total_norm for its dtype and device). No host
    synchronisation unless error_if_nonfinite=True, which costs one, as in torch.
    """
    if isinstance(parameters, torch.Tensor):
        params = [parameters]
    else:
        is_generator = isinstance(parameters, types.GeneratorType)
        params = list(parameters)
        if is_generator and not params:
            # stacklevel 3: past torch.no_grad's wrapper, to the caller's line (as torch's own)
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=3)
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = float(norm_type)
    total, precise = _norms(grads, norm_type, foreach)
    if error_if_nonfinite:
        _raise_if_nonfinite(total, norm_type)
    max_norm = float(max_norm)
    if grads:
        _clip(params, grads, max_norm, precise, foreach)
    return total


@torch.no_grad()
def clip_grad_value_(parameters: TensorOrTensors, clip_value: float, foreach: bool | None = None) -> None:
    """torch.nn.utils.clip_grad_value_: grads = clamp(grads, -clip_value, clip_value), in place.

    clip_value 0 zeroes, inf keeps, a negative value sets every element to it (torch.clamp's semantics).
    """
    params = _as_list(parameters)
    clip_value = float(clip_value)
    grads = [p.grad for p in params if p.grad is not None]
    fused, rest = _split(grads)
    if not fused or math.isnan(clip_value):
        torch.nn.utils.clip_grad_value_(params, clip_value, foreach)
        return
    for group in fused.values():
        api.clip_by_value_(group, clip_value)
    for g in rest:
        g.clamp_(min=-clip_value, max=clip_value)
