"""FusedAdamW: torch.optim.AdamW over the fused adamw_step_ op."""

from __future__ import annotations

from typing import Any

import torch

from ..ops import adamw_step_
from ..ops.optim_args import AdamWStep
from ._fused import DEFAULT_PARAM_MODE, FusedOptimizer, check_betas_and_decay
from .shards import on_local_shards
from .state_storage import DEFAULT_INT8_MIN_NUMEL, DEFAULT_STATE_DTYPE


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

    ``state_dtype`` stores exp_avg / exp_avg_sq (docs: "Low-memory optimizer states"): "fp32" (default,
    torch's format), "bf16" (stochastic rounding from ``seed``) or "int8" (blockwise 8-bit codes with one
    float32 scale per 256 elements; exp_avg on a signed map, exp_avg_sq on an unsigned one). With "int8",
    tensors of fewer than ``int8_min_numel`` elements keep fp32 states; amsgrad is refused. float64 params
    always keep float64 states. Both are group keys (saved with the checkpoint, like lr).
    """

    _state_keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    _record = AdamWStep
    _op = staticmethod(adamw_step_)

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
        state_dtype: str = DEFAULT_STATE_DTYPE,
        int8_min_numel: int = DEFAULT_INT8_MIN_NUMEL,
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
            params, defaults, max_grad_norm=max_grad_norm, param_mode=param_mode, seed=seed, backend=backend,
            state_dtype=state_dtype, int8_min_numel=int8_min_numel,
        )  # fmt: skip

    def _used_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return self._state_keys if group["amsgrad"] else self._state_keys[:2]

    def _options(self, group: dict[str, Any]) -> dict[str, Any]:
        return adam_options(group)


def adam_options(group: dict[str, Any]) -> dict[str, Any]:
    """adamw_step_'s options from a torch.optim.AdamW / Adam / FusedAdamW param group."""
    beta1, beta2 = group["betas"]
    return {
        "betas": (float(beta1), float(beta2)),
        "eps": float(group["eps"]),
        "weight_decay": float(group["weight_decay"]),
    }


def step_adam_group(group: dict, params: list, grads: list, states: list, steps: list, max_sqs: list, **kwargs) -> None:
    """One adamw_step_ call over a torch.optim.AdamW / Adam param group (torch_steps.py): its state dicts hold
    float exp_avg / exp_avg_sq tensors in torch's format."""
    on_local_shards(adamw_step_)(
        params,
        grads,
        [s["exp_avg"] for s in states],
        [s["exp_avg_sq"] for s in states],
        steps,
        max_exp_avg_sqs=max_sqs,
        **adam_options(group),
        **kwargs,
    )
