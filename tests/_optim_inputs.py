"""Fresh random inputs of the fused optimizer steps, and the same state inside torch.optim."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from _oracle import rand_list

from gradacc_ext.ops._checks_optim import state_dtype

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
