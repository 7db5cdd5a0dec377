"""The fused optimizer steps as Python functions: backend choice as in api.py.

Each is torch.optim.AdamW's (or SGD's) update over whole lists in one pass over memory, with
three things folded in that torch spends extra passes on:

* ``grad_mult``: one device scalar multiplying every grad (loss-scale inverse x clip
  coefficient x normaliser), so unscaling and clipping need no pass of their own;
* ``found_inf``: when nonzero, nothing is written at all (params, state, step counts);
* grads may be fp32 accumulation buffers for 16-bit (or fp64) params.

``lr`` may be a float or a one-element float32 device tensor (schedulers keep floats).
No function synchronises the host.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from . import _aliasing, _checks_optim, reference_optim
from ._checks import list_device
from .api import Backend, _as_list, _nothing, _run, _split_scale

Mode = str  # "nearest" | "master" | "stochastic"


def _mode(op: str, mode: Mode) -> int:
    if mode not in _checks_optim.MODES:
        raise ValueError(f"{op}: mode must be one of {tuple(_checks_optim.MODES)}, got {mode!r}")
    return _checks_optim.MODES[mode]


def _lists(op: str, **named: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    return [_as_list(op, tensors, arg) for arg, tensors in named.items()]


def adamw_step_(
    params: Iterable[torch.Tensor],
    grads: Iterable[torch.Tensor],
    exp_avgs: Iterable[torch.Tensor],
    exp_avg_sqs: Iterable[torch.Tensor],
    steps: Iterable[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    max_exp_avg_sqs: Iterable[torch.Tensor] = (),
    master_params: Iterable[torch.Tensor] = (),
    grad_mult: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    maximize: bool = False,
    mode: Mode = "nearest",
    seed: int = 0,
    backend: Backend = "auto",
) -> None:
    """One AdamW step (torch.optim.AdamW semantics; amsgrad when max_exp_avg_sqs is given).

    State is float32 (float64 for float64 params). `steps`: one-element float32 step counts, one
    per param or one shared, incremented here. `mode` stores 16-bit params: "nearest" rounding,
    "master" (update the float32 `master_params` and round them into the params) or
    "stochastic" rounding, reproducible from `seed` and the step count.
    """
    op = "gradacc.adamw_step_"
    params, grads, exp_avgs, exp_avg_sqs, max_sqs, masters, steps = _lists(
        op,
        params=params,
        grads=grads,
        exp_avgs=exp_avgs,
        exp_avg_sqs=exp_avg_sqs,
        max_exp_avg_sqs=max_exp_avg_sqs,
        master_params=master_params,
        steps=steps,
    )
    _aliasing.check_outputs(
        op, params=params, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, max_exp_avg_sqs=max_sqs,
        master_params=masters, steps=steps,
    )  # fmt: skip
    lr_value, lr_tensor = _split_scale(lr)
    beta1, beta2 = (float(b) for b in betas)
    args = (
        params, grads, exp_avgs, exp_avg_sqs, max_sqs, masters, steps, lr_value, lr_tensor, grad_mult, found_inf,
        beta1, beta2, float(eps), float(weight_decay), bool(maximize), _mode(op, mode), int(seed),
    )  # fmt: skip

    def validate() -> None:
        _checks_optim.check_adamw_step(op, *args[:15], args[16])

    device = list_device(params, found_inf)
    _run("adamw_step_", device, backend, validate, args, None if params else _nothing, reference_optim)


def sgd_step_(
    params: Iterable[torch.Tensor],
    grads: Iterable[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    momentum_buffers: Iterable[torch.Tensor] = (),
    steps: Iterable[torch.Tensor] = (),
    master_params: Iterable[torch.Tensor] = (),
    grad_mult: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    maximize: bool = False,
    mode: Mode = "nearest",
    seed: int = 0,
    backend: Backend = "auto",
) -> None:
    """One SGD step (torch.optim.SGD semantics). With momentum, `momentum_buffers` and `steps` are
    required: a param whose step count is 0 starts its buffer from the gradient, as torch does.
    Modes as in adamw_step_ (stochastic rounding needs `steps` too)."""
    op = "gradacc.sgd_step_"
    params, grads, buffers, masters, steps = _lists(
        op,
        params=params, grads=grads, momentum_buffers=momentum_buffers, master_params=master_params, steps=steps
    )
    _aliasing.check_outputs(
        op, params=params, momentum_buffers=buffers, master_params=masters, steps=steps
    )  # fmt: skip
    lr_value, lr_tensor = _split_scale(lr)
    args = (
        params, grads, buffers, masters, steps, lr_value, lr_tensor, grad_mult, found_inf, float(momentum),
        float(dampening), float(weight_decay), bool(nesterov), bool(maximize), _mode(op, mode), int(seed),
    )  # fmt: skip

    def validate() -> None:
        _checks_optim.check_sgd_step(op, *args[:13], args[14])

    device = list_device(params, found_inf)
    _run("sgd_step_", device, backend, validate, args, None if params else _nothing, reference_optim)
