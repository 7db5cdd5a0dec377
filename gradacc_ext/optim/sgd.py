"""FusedSGD: torch.optim.SGD over the fused sgd_step_ op."""

from __future__ import annotations

from typing import Any

import torch

from ..ops import sgd_step_
from ..ops.optim_args import SGDStep
from ._fused import DEFAULT_PARAM_MODE, FusedOptimizer, new_step
from .state_storage import DEFAULT_INT8_MIN_NUMEL, DEFAULT_STATE_DTYPE


class FusedSGD(FusedOptimizer):
    """torch.optim.SGD in one pass per device; the extras are FusedAdamW's (max_grad_norm,
    param_mode, seed, float32 grads of 16-bit params, the GradScaler protocol).

    The state holds torch's ``momentum_buffer`` plus a float32 ``step`` count, which tells the
    first step (the buffer starts as that step's gradient) on the device, without a host sync;
    a torch.optim.SGD checkpoint without it loads as "past the first step" exactly when it has a
    momentum buffer.

    ``state_dtype`` ("fp32", "bf16", "int8" on a signed map) and ``int8_min_numel`` store the momentum buffer
    as FusedAdamW's do its moments (fp32 stays torch's format; float64 params keep float64 buffers).
    """

    _state_keys = ("momentum_buffer",)
    _record = SGDStep
    _op = staticmethod(sgd_step_)

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        max_grad_norm: float | None = None,
        param_mode: str = DEFAULT_PARAM_MODE,
        seed: int = 0,
        backend: str = "auto",
        state_dtype: str = DEFAULT_STATE_DTYPE,
        int8_min_numel: int = DEFAULT_INT8_MIN_NUMEL,
    ) -> None:
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
            "foreach": foreach,
            "differentiable": differentiable,
            "fused": fused,
        }
        super().__init__(
            params, defaults, max_grad_norm=max_grad_norm, param_mode=param_mode, seed=seed, backend=backend,
            state_dtype=state_dtype, int8_min_numel=int8_min_numel,
        )  # fmt: skip

    def _init_state(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        state["step"] = new_step(param, 1.0 if state.get("momentum_buffer") is not None else 0.0)

    def _used_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        # a fresh buffer is overwritten by the first step's gradient (its step count is 0)
        return self._state_keys if group["momentum"] != 0 else ()

    def _options(self, group: dict[str, Any]) -> dict[str, Any]:
        return {key: group[key] for key in ("momentum", "dampening", "weight_decay", "nesterov")}
