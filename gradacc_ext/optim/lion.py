"""FusedLion: the Lion optimizer (lion-pytorch's update) over the fused lion_step_ op."""

from __future__ import annotations

from typing import Any

import torch

from ..ops import lion_step_
from ._fused import DEFAULT_PARAM_MODE, FusedOptimizer, check_betas_and_decay, new_state, new_step
from .shards import on_local_shards


class FusedLion(FusedOptimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") in one pass per device.

    The update is lion-pytorch's ``Lion``, element by element::

        u = sign(beta1 * m + (1 - beta1) * g)
        p <- p * (1 - lr * weight_decay) - lr * u
        m <- beta2 * m + (1 - beta2) * g

    Same constructor and param groups as lion-pytorch's ``Lion(params, lr=1e-4, betas=(0.9, 0.99),
    weight_decay=0.0)``; the state holds its ``exp_avg`` (float32, float64 for float64 params) and
    a float32 ``step`` count, so checkpoints load both ways (a checkpoint without ``step`` counts
    from 0). Lion's update has the same size ``lr`` in every element, so it wants a learning rate
    3-10x smaller than AdamW's and a weight decay 3-10x larger.

    The extras are FusedAdamW's: ``max_grad_norm`` (global-norm clip folded into the step),
    ``param_mode`` for float16/bfloat16 params ("master", "stochastic", "nearest"), ``seed``,
    float32 grads of 16-bit params, ``maximize``, and the torch.amp.GradScaler protocol (the scale
    and found_inf are applied inside the step). ``step_grads(grads, grad_mult, found_inf)`` steps
    from given buffers, as GradientAccumulator's fused tail calls it.
    """

    _state_keys = ("exp_avg",)

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        max_grad_norm: float | None = None,
        param_mode: str = DEFAULT_PARAM_MODE,
        seed: int = 0,
        backend: str = "auto",
    ) -> None:
        check_betas_and_decay(betas, weight_decay)
        defaults = {
            "lr": lr,
            "betas": betas,
            "weight_decay": weight_decay,
            "maximize": maximize,
            "foreach": foreach,
            "differentiable": differentiable,
        }
        super().__init__(
            params, defaults, max_grad_norm=max_grad_norm, param_mode=param_mode, seed=seed, backend=backend
        )

    def _init_state(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        state["step"] = new_step(param)
        if state.get("exp_avg") is None:  # a lion-pytorch checkpoint brings its own
            state["exp_avg"] = new_state(param)

    def _run_op(self, group, params, grads, steps, masters, kwargs) -> None:
        beta1, beta2 = group["betas"]
        on_local_shards(lion_step_)(
            params,
            grads,
            [self.state[p]["exp_avg"] for p in params],
            betas=(float(beta1), float(beta2)),
            weight_decay=group["weight_decay"],
            steps=steps,
            master_params=masters,
            **kwargs,
        )
