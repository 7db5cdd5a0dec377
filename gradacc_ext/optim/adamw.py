"""FusedAdamW: torch.optim.AdamW over the fused adamw_step_ op."""

from __future__ import annotations

from typing import Any

import torch

from ..ops import adamw_step_
from ._fused import DEFAULT_PARAM_MODE, FusedOptimizer, check_betas_and_decay, new_state, new_step
from .shards import on_local_shards


class FusedAdamW(FusedOptimizer):
    """torch.optim.AdamW in one pass per device, with extras torch lacks.

    Same constructor, param groups and state_dict as torch.optim.AdamW: checkpoints load both ways
    and every LR scheduler works. foreach/fused/capturable are accepted and kept for checkpoints
    (the step is always fused and capturable); differentiable=True is refused.

    Extras (keyword-only): ``max_grad_norm`` clips the global L2 norm inside the step (one norm
    pass plus the step pass; the pre-clip norm is left in ``last_grad_norm``); ``param_mode``
    says how float16/bfloat16 params store their update: "master" (default: float32 master
    weights in the state, so the trajectory is fp32's at +4 bytes/param), "stochastic" (unbiased
    rounding, reproducible from ``seed``, no extra memory) or "nearest". A 16-bit param may carry
    a float32 ``.grad``; its state is float32.
    """

    _state_keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        max_grad_norm: float | None = None,
        param_mode: str = DEFAULT_PARAM_MODE,
        seed: int = 0,
        backend: str = "auto",
    ) -> None:
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        check_betas_and_decay(betas, weight_decay)
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "fused": fused,
            "decoupled_weight_decay": True,
        }
        super().__init__(
            params, defaults, max_grad_norm=max_grad_norm, param_mode=param_mode, seed=seed, backend=backend
        )

    def _init_state(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        state["step"] = new_step(param)
        state["exp_avg"] = new_state(param)
        state["exp_avg_sq"] = new_state(param)

    def _run_op(self, group, params, grads, steps, masters, kwargs) -> None:
        states = [self.state[p] for p in params]
        max_sqs = []
        if group["amsgrad"]:
            for state, p in zip(states, params, strict=True):
                if "max_exp_avg_sq" not in state:
                    state["max_exp_avg_sq"] = new_state(p)
                max_sqs.append(state["max_exp_avg_sq"])
        step_adam_group(group, params, grads, states, steps, max_sqs, master_params=masters, **kwargs)


def step_adam_group(group: dict, params: list, grads: list, states: list, steps: list, max_sqs: list, **kwargs) -> None:
    """One adamw_step_ call over a param group whose state dicts hold exp_avg / exp_avg_sq (torch's names, which
    FusedAdamW keeps): FusedAdamW's step and torch.optim.AdamW/Adam's fused tail (torch_steps.py) share it."""
    beta1, beta2 = group["betas"]
    on_local_shards(adamw_step_)(
        params,
        grads,
        [s["exp_avg"] for s in states],
        [s["exp_avg_sq"] for s in states],
        steps,
        betas=(float(beta1), float(beta2)),
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        max_exp_avg_sqs=max_sqs,
        **kwargs,
    )
