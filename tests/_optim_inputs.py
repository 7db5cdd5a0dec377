"""The optimizer test table (as torch's OptimizerInfo), fresh random inputs of the fused optimizer
steps, and the same state inside torch.optim.

OPTIMIZERS has one row per fused optimizer op: its argument record, its public function, its fused
optimizer class, the configs whose options reach each branch of its element math, and an oracle
optimizer independent of our reference (torch.optim's own, lion-pytorch's Lion). The op, emulation
and optimizer tests parametrize over the rows, so a new optimizer's tests come from its row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from _oracle import rand_list

from gradacc_ext.ops import adamw_step_, lion_step_, sgd_step_
from gradacc_ext.ops._checks_optim import state_dtype
from gradacc_ext.ops.optim_args import MODES, AdamWStep, LionStep, OptimStep, SGDStep
from gradacc_ext.optim import FusedAdamW, FusedLion, FusedSGD

# Options of the op tests and the emulation: each config reaches a different branch of the element math.
SGD_CONFIGS = {
    "plain": {},
    "momentum": {"momentum": 0.9},
    "damped_decay": {"momentum": 0.8, "dampening": 0.3, "weight_decay": 0.05},
    "nesterov_max": {"momentum": 0.9, "nesterov": True, "maximize": True, "weight_decay": 0.01},
}
ADAM_CONFIGS = {
    "plain": {},
    "amsgrad": {"amsgrad": True, "weight_decay": 0.1},
    "maximize": {"maximize": True, "betas": (0.6, 0.95)},
    "beta1_large": {"amsgrad": True, "betas": (0.3, 0.5), "eps": 1e-3},  # lerp's second branch
}
LION_CONFIGS = {
    "plain": {},
    "decay": {"weight_decay": 0.5},
    "maximize": {"maximize": True, "betas": (0.5, 0.9), "weight_decay": 0.1},
}


@dataclass
class StepInputs:
    """Every tensor argument of adamw_step_ / sgd_step_ (unused lists stay empty)."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor] = field(default_factory=list)  # SGD: the momentum buffers
    exp_avg_sqs: list[torch.Tensor] = field(default_factory=list)
    max_exp_avg_sqs: list[torch.Tensor] = field(default_factory=list)
    master_params: list[torch.Tensor] = field(default_factory=list)
    steps: list[torch.Tensor] = field(default_factory=list)

    def lists(self) -> list[list[torch.Tensor]]:
        return [self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.max_exp_avg_sqs, self.master_params]

    def all_tensors(self) -> list[torch.Tensor]:
        return [t for group in (*self.lists(), self.steps) for t in group]

    def clone(self) -> StepInputs:
        return StepInputs(*([t.clone() for t in group] for group in (*self.lists(), self.steps)))


def make_inputs(
    sizes: Sequence[int],
    param_dtype: torch.dtype,
    device: str,
    gen: torch.Generator,
    *,
    grad_dtype: torch.dtype | None = None,
    optimizer: str = "adamw",
    amsgrad: bool = False,
    masters: bool = False,
    unaligned: bool = False,
    shared_step: bool = False,
    first_step: bool = False,
) -> StepInputs:
    """Random params, grads and state; step counts drawn in [1, 20) (0 with first_step)."""
    sdt = state_dtype(param_dtype)
    params = rand_list(sizes, param_dtype, device, gen, unaligned=unaligned)
    grads = rand_list(sizes, grad_dtype or param_dtype, device, gen, unaligned=unaligned)
    inputs = StepInputs(params, grads)
    inputs.exp_avgs = rand_list(sizes, sdt, device, gen, unaligned=unaligned, std=0.1)
    if optimizer == "adamw":
        inputs.exp_avg_sqs = [t.square() for t in rand_list(sizes, sdt, device, gen, std=0.1)]
        if amsgrad:
            extra = rand_list(sizes, sdt, device, gen, std=0.05)
            inputs.max_exp_avg_sqs = [v + e.square() for v, e in zip(inputs.exp_avg_sqs, extra, strict=True)]
    if masters:
        # a master differs from its rounded param by less than half a 16-bit ulp
        noise = rand_list(sizes, torch.float32, device, gen, std=2.0**-12)
        inputs.master_params = [p.float() * (1 + e) for p, e in zip(params, noise, strict=True)]
    count = 1 if shared_step else len(sizes)
    values = torch.zeros(count) if first_step else torch.randint(1, 20, (count,), generator=gen).float()
    inputs.steps = [torch.full((), float(v), device=device) for v in values]
    return inputs


def torch_optimizer(inputs: StepInputs, kind: str, **options) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    """A torch.optim.AdamW/SGD holding copies of `inputs` (params, grads and state)."""
    leaves = [p.detach().clone().requires_grad_(True) for p in inputs.params]
    for leaf, g in zip(leaves, inputs.grads, strict=True):
        leaf.grad = g.clone()
    opt = (torch.optim.AdamW if kind == "adamw" else torch.optim.SGD)(leaves, **options)
    for i, leaf in enumerate(leaves):
        state = opt.state[leaf]
        if kind == "adamw":
            state["step"] = inputs.steps[i].detach().clone()
            state["exp_avg"] = inputs.exp_avgs[i].clone()
            state["exp_avg_sq"] = inputs.exp_avg_sqs[i].clone()
            if inputs.max_exp_avg_sqs:
                state["max_exp_avg_sq"] = inputs.max_exp_avg_sqs[i].clone()
        elif inputs.steps and float(inputs.steps[i]) > 0:
            state["momentum_buffer"] = inputs.exp_avgs[i].clone()
    return opt, leaves


def _lion_oracle(params, **options) -> torch.optim.Optimizer:
    from lion_pytorch import Lion  # the test extra (pyproject); imported where used

    return Lion(params, **options)


@dataclass(frozen=True)
class OptimInfo:
    """One fused optimizer: the row of the test table."""

    name: str
    record: type[OptimStep]
    fused: type[torch.optim.Optimizer]
    oracle: Callable[..., torch.optim.Optimizer]  # the same optimizer, not ours (for test_optim.py)
    configs: dict[str, dict]  # op options (the public function's keywords, amsgrad for AdamW)
    lr: float
    call: Callable[..., None]  # call(x, backend, lr, **options): the public op on StepInputs

    @property
    def op(self) -> str:
        return self.record.NAME

    def record_of(self, x: StepInputs, options: dict, lr: float, tensors: tuple, mode: str, seed: int) -> OptimStep:
        """The op's argument record on `x`; tensors: (lr_tensor, grad_mult, found_inf)."""
        opts = dict(options)
        opts.pop("amsgrad", None)
        beta1, beta2 = opts.pop("betas", self.record_defaults.get("betas", (0.9, 0.999)))
        values = {**self.record_defaults, **opts, "beta1": beta1, "beta2": beta2}
        lists = {"exp_avgs": x.exp_avgs, "exp_avg_sqs": x.exp_avg_sqs, "max_exp_avg_sqs": x.max_exp_avg_sqs,
                 "momentum_buffers": x.exp_avgs if values.get("momentum") else []}  # fmt: skip
        fields = {name: lists[name] for name, _ in self.record.STATE}
        fields |= {name: values[name] for name in self.record.OPTIONS}
        lr_tensor, grad_mult, found_inf = tensors
        return self.record(
            params=x.params, grads=x.grads, master_params=x.master_params, steps=x.steps, lr=lr,
            lr_tensor=lr_tensor, grad_mult=grad_mult, found_inf=found_inf, maximize=values.get("maximize", False),
            param_mode=MODES[mode], seed=seed, **fields,
        )  # fmt: skip

    @property
    def record_defaults(self) -> dict[str, Any]:
        return _DEFAULTS[self.name]


_DEFAULTS: dict[str, dict[str, Any]] = {
    "adamw": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    "sgd": {"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
    "lion": {"betas": (0.9, 0.99), "weight_decay": 0.0},
}


def _call_adamw(x: StepInputs, backend: str, lr, **kw) -> None:
    opts = {k: v for k, v in kw.items() if k != "amsgrad"}
    adamw_step_(
        x.params, x.grads, x.exp_avgs, x.exp_avg_sqs, x.steps, lr=lr, max_exp_avg_sqs=x.max_exp_avg_sqs,
        master_params=x.master_params, backend=backend, **opts,
    )  # fmt: skip


def _call_sgd(x: StepInputs, backend: str, lr, **kw) -> None:
    buffers = x.exp_avgs if kw.get("momentum", 0.0) else []
    sgd_step_(x.params, x.grads, lr=lr, momentum_buffers=buffers, steps=x.steps, master_params=x.master_params,
              backend=backend, **kw)  # fmt: skip


def _call_lion(x: StepInputs, backend: str, lr, **kw) -> None:
    lion_step_(x.params, x.grads, x.exp_avgs, lr=lr, steps=x.steps, master_params=x.master_params, backend=backend,
               **kw)  # fmt: skip


OPTIMIZERS = [
    OptimInfo("adamw", AdamWStep, FusedAdamW, torch.optim.AdamW, ADAM_CONFIGS, 1e-2, _call_adamw),
    OptimInfo("sgd", SGDStep, FusedSGD, torch.optim.SGD, SGD_CONFIGS, 0.05, _call_sgd),
    OptimInfo("lion", LionStep, FusedLion, _lion_oracle, LION_CONFIGS, 1e-3, _call_lion),
]
BY_NAME = {info.name: info for info in OPTIMIZERS}


def row_configs(names: Sequence[str] | None = None) -> list:
    """(optimizer, config) pairs of the table, for pytest.mark.parametrize (ids "adamw-plain", ...)."""
    return [
        pytest.param(info, config, id=f"{info.name}-{config}")
        for info in OPTIMIZERS
        if names is None or info.name in names
        for config in info.configs
    ]
