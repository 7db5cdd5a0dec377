"""FusedLion: the Lion optimizer (lion-pytorch's update) over the fused lion_step_ op."""

from __future__ import annotations

from typing import Any

import torch

from ..ops import lion_step_
from ..ops.optim_args import LionStep
from ._fused import DEFAULT_PARAM_MODE, FusedOptimizer, check_betas_and_decay
from .state_storage import DEFAULT_INT8_MIN_NUMEL, DEFAULT_STATE_DTYPE


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

    ``state_dtype`` ("fp32", "bf16", "int8" on a signed map) and ``int8_min_numel`` store ``exp_avg`` as
    FusedAdamW's do its moments (fp32, the default, is lion-pytorch's format; float64 params keep float64).
    """

    _state_keys = ("exp_avg",)
    _record = LionStep
    _op = staticmethod(lion_step_)

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
        state_dtype: str = DEFAULT_STATE_DTYPE,
        int8_min_numel: int = DEFAULT_INT8_MIN_NUMEL,
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
            params, defaults, max_grad_norm=max_grad_norm, param_mode=param_mode, seed=seed, backend=backend,
            state_dtype=state_dtype, int8_min_numel=int8_min_numel,
        )  # fmt: skip

    def _options(self, group: dict[str, Any]) -> dict[str, Any]:
        beta1, beta2 = group["betas"]
        return {"betas": (float(beta1), float(beta2)), "weight_decay": group["weight_decay"]}
