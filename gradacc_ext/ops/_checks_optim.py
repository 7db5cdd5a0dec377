"""Argument checks of the fused optimizer steps, rule for rule those of csrc/binding_optim.cpp.

Used by the reference path (optim_api.py) and the fake kernels (_fake.py): every backend
rejects the same input with the same exception type and a message naming the argument, before
anything is written. One check serves every op: it reads the op's record (optim_args.py), whose
own rules (options, state) it calls in the binding's order. The per-tensor checks are _checks.py's
(Use.STEP). Option errors use torch.optim's wording with the number as C++ prints it ("Invalid
learning rate: -1"), as the binding's messages do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ._checks import Use, check_list, check_pair_dtype, check_same_shape, check_scalar, check_tensor, list_device
from .constants import HALF_DTYPES, state_dtype
from .optim_args import MODES, STORAGES, OptimStep, invalid, scales_name
from .quant_maps import BLOCK

STATE_EXPECTED = "float32, bfloat16 or uint8 (float64 for a float64 param)"


def _check_companions(
    op: str,
    arg: str,
    tensors: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    optional: bool,
    expected: str,
    ok: Callable[[torch.dtype, torch.dtype], bool],
    use: Use = Use.STEP,
) -> None:
    if optional and not tensors:
        return
    if len(tensors) != len(params):
        extra = " or none" if optional else ""
        raise ValueError(f"{op}: {arg} must have one tensor per param ({len(params)}){extra}, got {len(tensors)}")
    for i, (t, p) in enumerate(zip(tensors, params, strict=True)):
        check_tensor(op, arg, i, t, p.device, use)
        check_same_shape(op, arg, i, t, "params", p)
        check_pair_dtype(ok(p.dtype, t.dtype), op, arg, i, t, "params", p, expected)


def _is_state(param: torch.dtype, state: torch.dtype) -> bool:
    """float64 for a float64 param (fp32 storage only), else float32, bfloat16 or uint8."""
    if param == torch.float64:
        return state == state_dtype(param)
    return state in (torch.float32, torch.bfloat16, torch.uint8)


def _check_storage(a: OptimStep) -> str:
    """The call's one storage, that of the first given state tensor (slot order): every other must share it."""
    given = [(name, tensors) for (name, _), tensors in zip(a.STATE, a.state(), strict=True) if tensors]
    if not given:
        return "fp32"
    first_name, first = given[0]
    storage = STORAGES[first[0].dtype]
    for name, tensors in given:
        for i, t in enumerate(tensors):
            if STORAGES[t.dtype] != storage:
                raise TypeError(
                    f"{a.op}: {name}[{i}] has dtype {t.dtype} but {first_name}[0] has dtype {first[0].dtype}; "
                    "all state lists must share one storage"
                )
    return storage


def _check_scales(a: OptimStep, storage: str) -> None:
    """The int8 rules: the slots the op refuses as int8, then the scales lists, given exactly for int8 state
    lists: one contiguous 1-D float32 tensor per param of one absmax per BLOCK elements."""
    op, int8 = a.op, storage == "int8"
    for (name, _), tensors, why in zip(a.STATE, a.state(), a.NO_INT8, strict=True):
        if int8 and tensors and why is not None:
            raise ValueError(
                f"{op}: {name} is uint8 (int8 states), which {why} does not support; use bf16 or fp32 states for {why}"
            )
    for (name, _), tensors, scales in zip(a.STATE, a.state(), a.scales(), strict=True):
        arg = scales_name(name)
        if not (int8 and tensors):
            if scales:
                raise ValueError(
                    f"{op}: {arg} must be empty unless {name} is int8 (uint8 codes), got {len(scales)} tensors"
                )
            continue
        if len(scales) != len(a.params):
            raise ValueError(
                f"{op}: {arg} must have one tensor per param ({len(a.params)}) as {name} is int8 (uint8 codes), "
                f"got {len(scales)}"
            )
        for i, (t, p) in enumerate(zip(scales, a.params, strict=True)):
            check_tensor(op, arg, i, t, p.device, Use.STEP)
            if t.dtype != torch.float32:
                raise TypeError(f"{op}: {arg}[{i}] has dtype {t.dtype}; expected float32")
            blocks = -(-p.numel() // BLOCK)
            if list(t.shape) != [blocks]:
                raise ValueError(
                    f"{op}: {arg}[{i}] has shape {list(t.shape)}; expected [{blocks}] (one float32 absmax per "
                    f"{BLOCK} elements of params[{i}])"
                )


def check_step(a: OptimStep) -> None:
    """Every rule of the op's binding, in its order: options, the shared lists and scalars, state."""
    op = a.op
    a.check_options()
    invalid(math.isfinite(a.lr) and a.lr >= 0.0, op, "learning rate", a.lr)
    invalid(math.isfinite(a.weight_decay) and a.weight_decay >= 0.0, op, "weight_decay value", a.weight_decay)
    mode = a.param_mode
    if mode not in MODES.values():
        raise ValueError(f"{op}: mode must be 0 (nearest), 1 (master) or 2 (stochastic), got {mode}")
    params, steps = a.params, a.steps
    device = list_device(params, a.found_inf)
    check_list(op, "params", params, device, Use.STEP)
    _check_companions(
        op, "grads", a.grads, params, False, "the param's dtype or float32", lambda p, g: g in (p, torch.float32)
    )
    _check_companions(
        op,
        "master_params",
        a.master_params,
        params,
        True,
        "float32 (master weights of a float16 or bfloat16 param)",
        lambda p, m: m == torch.float32 and p in HALF_DTYPES,
    )
    if params and (mode == MODES["master"]) != bool(a.master_params):
        raise ValueError(
            f"{op}: master_params must be given exactly when mode is 1 (master), "
            f"got {len(a.master_params)} tensors with mode {mode}"
        )
    steps_required = a.steps_required()
    if not (len(steps) in (1, len(params)) or (not steps_required and not steps)):
        none = "" if steps_required else " (or none)"
        raise ValueError(
            f"{op}: steps must hold one tensor per param ({len(params)}) or one shared by all{none}, got {len(steps)}"
        )
    for i, s in enumerate(steps):
        check_scalar(op, f"steps[{i}]", s, device)
    for arg in ("lr_tensor", "grad_mult", "found_inf"):
        if getattr(a, arg) is not None:
            check_scalar(op, arg, getattr(a, arg), device)
    for arg, optional in a.STATE:
        _check_companions(op, arg, getattr(a, arg), params, optional, STATE_EXPECTED, _is_state, Use.STEP_STATE)
    storage = _check_storage(a)
    if storage == "bf16" and params and not steps:
        raise ValueError(
            f"{op}: steps must be given for bfloat16 states (their stochastic rounding draws a fresh stream per step)"
        )
    a.check_state()
    _check_scales(a, storage)
