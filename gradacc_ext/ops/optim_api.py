"""The fused optimizer steps as Python functions: backend choice as in api.py.

Each is torch.optim.AdamW's (SGD's, or lion-pytorch's Lion's) update over whole lists in one
pass over memory, with three things folded in that torch spends extra passes on:

* ``grad_mult``: one device scalar multiplying every grad (loss-scale inverse x clip
  coefficient x normaliser), so unscaling and clipping need no pass of their own;
* ``found_inf``: when nonzero, nothing is written at all (params, state, step counts);
* grads may be fp32 accumulation buffers for 16-bit (or fp64) params.

The state lists may be float32 (float64 for float64 params), bfloat16 (stored with stochastic rounding,
reproducible from ``seed`` and the step count) or uint8 (int8: blockwise-quantized codes, each list then
with its ``<state>_scales`` keyword: one float32 tensor per param of ``ceil(numel / 256)`` block absmaxes,
read and written; zeros for a fresh state). One storage for all the state lists of a call.

``lr`` may be a float or a one-element float32 device tensor (schedulers keep floats).
No function synchronises the host.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from . import _aliasing, reference_optim
from ._checks import list_device
from ._checks_optim import check_step
from .api import Backend, _as_list, _defined, _nothing, _run, _split_scale
from .optim_args import MODES, AdamWStep, LionStep, OptimStep, SGDStep, scales_name

Mode = str  # "nearest" | "master" | "stochastic"


def _mode(op: str, mode: Mode) -> int:
    if mode not in MODES:
        raise ValueError(f"{op}: mode must be one of {tuple(MODES)}, got {mode!r}")
    return MODES[mode]


def _lists(op: str, **named: Iterable[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    return {arg: _as_list(tensors, arg) for arg, tensors in named.items()}


def _common(op: str, lr: float | torch.Tensor, maximize: bool, mode: Mode, seed: int) -> dict:
    """The record fields every step takes from the same keywords."""
    lr_value, lr_tensor = _split_scale(lr)
    return {"lr": lr_value, "lr_tensor": lr_tensor, "maximize": bool(maximize), "param_mode": _mode(op, mode),
            "seed": int(seed)}  # fmt: skip


def _step(a: OptimStep, backend: Backend) -> None:
    state = {name: getattr(a, name) for name, _ in a.STATE}
    scales = {scales_name(name): getattr(a, scales_name(name)) for name in state}
    outputs = {"params": a.params, **state, **scales}
    outputs.update(master_params=a.master_params, steps=a.steps)
    _aliasing.check_leaves(a.op, **outputs)
    # No input may be an output, not even its own pair (ops/_aliasing.py).
    inputs = {"grads": a.grads, "lr_tensor": a.lr_tensor, "grad_mult": a.grad_mult, "found_inf": a.found_inf}

    def validate() -> None:
        _defined(a.op, params=a.params, grads=a.grads, **state, **scales)
        _defined(a.op, master_params=a.master_params, steps=a.steps)
        _aliasing.check_disjoint(a.op, outputs, inputs)
        check_step(a)
        _aliasing.check_scalars_disjoint(a.op, outputs, inputs)

    device = list_device(a.params, a.found_inf)
    empty = None if a.params else _nothing
    _run(a.NAME, device, backend, validate, a.args(), empty, reference_optim, (a,))


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
    exp_avgs_scales: Iterable[torch.Tensor] = (),
    exp_avg_sqs_scales: Iterable[torch.Tensor] = (),
    max_exp_avg_sqs_scales: Iterable[torch.Tensor] = (),
    master_params: Iterable[torch.Tensor] = (),
    grad_mult: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    maximize: bool = False,
    mode: Mode = "nearest",
    seed: int = 0,
    backend: Backend = "auto",
) -> None:
    """One AdamW step (torch.optim.AdamW semantics; amsgrad when max_exp_avg_sqs is given).

    State as the module says (the `*_scales` lists with uint8 states). `steps`: one-element float32 step counts, one
    per param or one shared, incremented here. `mode` stores 16-bit params: "nearest" rounding,
    "master" (update the float32 `master_params` and round them into the params) or
    "stochastic" rounding, reproducible from `seed` and the step count.
    """
    op = "gradacc.adamw_step_"
    lists = _lists(
        op,
        params=params,
        grads=grads,
        exp_avgs=exp_avgs,
        exp_avg_sqs=exp_avg_sqs,
        max_exp_avg_sqs=max_exp_avg_sqs,
        exp_avgs_scales=exp_avgs_scales,
        exp_avg_sqs_scales=exp_avg_sqs_scales,
        max_exp_avg_sqs_scales=max_exp_avg_sqs_scales,
        master_params=master_params,
        steps=steps,
    )
    beta1, beta2 = (float(b) for b in betas)
    record = AdamWStep(
        **lists, grad_mult=grad_mult, found_inf=found_inf, beta1=beta1, beta2=beta2, eps=float(eps),
        weight_decay=float(weight_decay), **_common(op, lr, maximize, mode, seed),
    )  # fmt: skip
    _step(record, backend)


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
    momentum_buffers_scales: Iterable[torch.Tensor] = (),
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
    lists = _lists(
        op,
        params=params, grads=grads, momentum_buffers=momentum_buffers,
        momentum_buffers_scales=momentum_buffers_scales, master_params=master_params, steps=steps,
    )  # fmt: skip
    record = SGDStep(
        **lists, grad_mult=grad_mult, found_inf=found_inf, momentum=float(momentum), dampening=float(dampening),
        weight_decay=float(weight_decay), nesterov=bool(nesterov), **_common(op, lr, maximize, mode, seed),
    )  # fmt: skip
    _step(record, backend)


def lion_step_(
    params: Iterable[torch.Tensor],
    grads: Iterable[torch.Tensor],
    exp_avgs: Iterable[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    betas: tuple[float, float] = (0.9, 0.99),
    weight_decay: float = 0.0,
    exp_avgs_scales: Iterable[torch.Tensor] = (),
    steps: Iterable[torch.Tensor] = (),
    master_params: Iterable[torch.Tensor] = (),
    grad_mult: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    maximize: bool = False,
    mode: Mode = "nearest",
    seed: int = 0,
    backend: Backend = "auto",
) -> None:
    """One Lion step (lion-pytorch's update): ``p <- p * (1 - lr * wd) - lr * sign(b1 * m + (1 - b1) * g)``,
    then ``m <- b2 * m + (1 - b2) * g``. `steps` (counted as in adamw_step_) are needed only for
    stochastic rounding; modes as in adamw_step_."""
    op = "gradacc.lion_step_"
    lists = _lists(
        op, params=params, grads=grads, exp_avgs=exp_avgs, exp_avgs_scales=exp_avgs_scales,
        master_params=master_params, steps=steps,
    )  # fmt: skip
    beta1, beta2 = (float(b) for b in betas)
    record = LionStep(
        **lists, grad_mult=grad_mult, found_inf=found_inf, beta1=beta1, beta2=beta2,
        weight_decay=float(weight_decay), **_common(op, lr, maximize, mode, seed),
    )  # fmt: skip
    _step(record, backend)
