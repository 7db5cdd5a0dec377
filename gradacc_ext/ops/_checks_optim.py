"""Argument checks of the fused optimizer steps, rule for rule those of csrc/binding_optim.cpp.

Used by the reference path (optim_api.py) and the fake kernels (_fake_optim.py): every backend
rejects the same input with the same exception type and a message naming the argument, before
anything is written. The per-tensor checks are _checks.py's (Use.STEP). Option errors use torch.optim's
wording with the number as C++ prints it ("Invalid learning rate: -1"), as the binding's messages do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ._checks import Use, check_list, check_pair_dtype, check_same_shape, check_scalar, check_tensor, list_device, num

LOW = (torch.float16, torch.bfloat16)
MODES = {"nearest": 0, "master": 1, "stochastic": 2}
STATE_EXPECTED = "float32 (float64 for a float64 param)"


def state_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """The optimizer state's dtype for a param: float64 for float64 params, float32 otherwise."""
    return torch.float64 if param_dtype == torch.float64 else torch.float32


def _check_companions(
    op: str,
    arg: str,
    tensors: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    optional: bool,
    expected: str,
    ok: Callable[[torch.dtype, torch.dtype], bool],
) -> None:
    if optional and not tensors:
        return
    if len(tensors) != len(params):
        extra = " or none" if optional else ""
        raise ValueError(f"{op}: {arg} must have one tensor per param ({len(params)}){extra}, got {len(tensors)}")
    for i, (t, p) in enumerate(zip(tensors, params, strict=True)):
        check_tensor(op, arg, i, t, p.device, Use.STEP)
        check_same_shape(op, arg, i, t, "params", p)
        check_pair_dtype(ok(p.dtype, t.dtype), op, arg, i, t, "params", p, expected)


def _is_state(param: torch.dtype, state: torch.dtype) -> bool:
    return state == state_dtype(param)


def _invalid(ok: bool, op: str, what: str, value: float) -> None:
    if not ok:
        raise ValueError(f"{op}: Invalid {what}: {num(value)}")


def _check_common(
    op: str,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    master_params: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    steps_required: bool,
    lr: float,
    lr_tensor: torch.Tensor | None,
    grad_mult: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    weight_decay: float,
    mode: int,
) -> None:
    _invalid(math.isfinite(lr) and lr >= 0.0, op, "learning rate", lr)
    _invalid(math.isfinite(weight_decay) and weight_decay >= 0.0, op, "weight_decay value", weight_decay)
    if mode not in MODES.values():
        raise ValueError(f"{op}: mode must be 0 (nearest), 1 (master) or 2 (stochastic), got {mode}")
    device = list_device(params, found_inf)
    check_list(op, "params", params, device, Use.STEP)
    _check_companions(
        op, "grads", grads, params, False, "the param's dtype or float32", lambda p, g: g in (p, torch.float32)
    )
    _check_companions(
        op,
        "master_params",
        master_params,
        params,
        True,
        "float32 (master weights of a float16 or bfloat16 param)",
        lambda p, m: m == torch.float32 and p in LOW,
    )
    if params and (mode == MODES["master"]) != bool(master_params):
        raise ValueError(
            f"{op}: master_params must be given exactly when mode is 1 (master), "
            f"got {len(master_params)} tensors with mode {mode}"
        )
    if not (len(steps) in (1, len(params)) or (not steps_required and not steps)):
        none = "" if steps_required else " (or none)"
        raise ValueError(
            f"{op}: steps must hold one tensor per param ({len(params)}) or one shared by all{none}, got {len(steps)}"
        )
    for i, s in enumerate(steps):
        check_scalar(op, f"steps[{i}]", s, device)
    for arg, t in (("lr_tensor", lr_tensor), ("grad_mult", grad_mult), ("found_inf", found_inf)):
        if t is not None:
            check_scalar(op, arg, t, device)


def check_adamw_step(
    op: str,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    max_exp_avg_sqs: Sequence[torch.Tensor],
    master_params: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    lr: float,
    lr_tensor: torch.Tensor | None,
    grad_mult: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    mode: int,
) -> None:
    _invalid(math.isfinite(eps) and eps >= 0.0, op, "epsilon value", eps)
    for index, beta in enumerate((beta1, beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{op}: Invalid beta parameter at index {index}: {num(beta)}")
    _check_common(
        op, params, grads, master_params, steps, True, lr, lr_tensor, grad_mult, found_inf, weight_decay, mode
    )
    _check_companions(op, "exp_avgs", exp_avgs, params, False, STATE_EXPECTED, _is_state)
    _check_companions(op, "exp_avg_sqs", exp_avg_sqs, params, False, STATE_EXPECTED, _is_state)
    _check_companions(op, "max_exp_avg_sqs", max_exp_avg_sqs, params, True, STATE_EXPECTED, _is_state)


def check_sgd_step(
    op: str,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    master_params: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    lr: float,
    lr_tensor: torch.Tensor | None,
    grad_mult: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    mode: int,
) -> None:
    _invalid(math.isfinite(momentum) and momentum >= 0.0, op, "momentum value", momentum)
    _invalid(math.isfinite(dampening), op, "dampening value", dampening)
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ValueError(f"{op}: Nesterov momentum requires a momentum and zero dampening")
    steps_required = momentum != 0.0 or mode == MODES["stochastic"]
    _check_common(
        op, params, grads, master_params, steps, steps_required, lr, lr_tensor, grad_mult, found_inf, weight_decay, mode
    )
    _check_companions(op, "momentum_buffers", momentum_buffers, params, True, STATE_EXPECTED, _is_state)
    if momentum != 0.0 and params and not momentum_buffers:
        raise ValueError(f"{op}: momentum_buffers must be given when momentum != 0")
