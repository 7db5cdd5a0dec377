"""What FusedAdamW and FusedSGD share: the GradScaler protocol, the optional global-norm clip,
bucketing a group's params into op calls, and checkpoints that stay torch's format.

A step is at most two passes over the grads: the norm (only with max_grad_norm) and the fused
op. The loss-scale inverse and the clip coefficient become one device scalar, `grad_mult`,
which the op applies to every grad as it reads it; found_inf makes the op write nothing.
Nothing synchronises the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..ops import global_norm
from ..ops.constants import DEFAULT_EPS as CLIP_EPS
from ..ops.constants import HALF_DTYPES, state_dtype
from ..ops.norms import combine_norms
from ..ops.optim_args import MODES, check_betas
from .shards import is_sharded

PARAM_MODES = tuple(MODES)
DEFAULT_PARAM_MODE = "master"


def check_betas_and_decay(betas: tuple[float, float], weight_decay: float) -> None:
    """torch.optim's checks of betas (the ops' own rule, optim_args.check_betas) and weight_decay (FusedAdamW,
    FusedLion)."""
    check_betas(betas)
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def _norm_of(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of grads on one device: the fused global_norm, torch's for float64."""
    if any(g.dtype == torch.float64 for g in grads):
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads]))
    return global_norm(grads, 2.0)


class FusedOptimizer(torch.optim.Optimizer):
    """Base of the fused optimizers; subclasses define `_run_op` and `_init_state`."""

    _step_supports_amp_scaling = True  # torch.amp.GradScaler hands us grad_scale and found_inf
    _state_keys: tuple[str, ...] = ()  # per-param state held in state_dtype(param)

    def __init__(
        self,
        params: Any,
        defaults: dict[str, Any],
        *,
        max_grad_norm: float | None,
        param_mode: str,
        seed: int,
        backend: str,
    ) -> None:
        if defaults.get("differentiable"):
            raise ValueError(f"{type(self).__name__} does not support differentiable=True")
        if not isinstance(defaults["lr"], torch.Tensor) and not (math.isfinite(defaults["lr"]) and defaults["lr"] >= 0):
            raise ValueError(f"Invalid learning rate: {defaults['lr']}")
        if max_grad_norm is not None and not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be finite and > 0, got {max_grad_norm}")
        if param_mode not in PARAM_MODES:
            raise ValueError(f"param_mode must be one of {PARAM_MODES}, got {param_mode!r}")
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.param_mode = param_mode
        self.seed = int(seed)
        self.backend = backend
        self.last_grad_norm: torch.Tensor | None = None  # the pre-clip norm of the last step (max_grad_norm)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # a torch checkpoint may lack some of our group keys
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    # ---- checkpoints ----------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader casts state to the param's dtype; ours is float32 for 16-bit params (and
        the step count a float32 tensor beside its param), so the saved tensors are re-read exactly."""
        super().load_state_dict(state_dict)
        saved_ids = (pid for group in state_dict["param_groups"] for pid in group["params"])
        params = (p for group in self.param_groups for p in group["params"])
        by_id = dict(zip(saved_ids, params, strict=False))
        for pid, saved in state_dict["state"].items():
            param = by_id.get(pid)
            if param is not None:
                self._adopt_state(param, saved)

    def _adopt_state(self, param: torch.Tensor, saved: dict[str, Any]) -> None:
        state = self.state[param]
        for key in self._state_keys:
            if isinstance(saved.get(key), torch.Tensor):
                state[key] = saved[key].to(device=param.device, dtype=state_dtype(param.dtype), copy=True)
        if isinstance(saved.get("master_param"), torch.Tensor):
            state["master_param"] = saved["master_param"].to(device=param.device, dtype=torch.float32, copy=True)
        if "step" in saved:
            step = saved["step"]
            value = step if isinstance(step, torch.Tensor) else torch.tensor(float(step))
            state["step"] = value.to(device=param.device, dtype=torch.float32, copy=True).reshape(())

    # ---- the step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        grad_scale: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> Any:
        """One step of every group. grad_scale: the grads are scaled by it (the step divides it
        out); found_inf: nonzero skips the step entirely. Both default to the attributes that
        torch.amp.GradScaler sets on fused optimizers."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = grad_scale if grad_scale is not None else getattr(self, "grad_scale", None)
        found_inf = found_inf if found_inf is not None else getattr(self, "found_inf", None)
        work = [(group, [p for p in group["params"] if p.grad is not None]) for group in self.param_groups]
        for _, params in work:
            for p in params:
                if p.grad.layout != torch.strided:
                    raise ValueError(f"{type(self).__name__} does not support sparse gradients ({p.grad.layout})")
        if not any(params for _, params in work):
            return loss
        device = next(params[0].device for _, params in work if params)
        grad_mult = None if grad_scale is None else torch.reciprocal(grad_scale.to(device, torch.float32))
        grad_mult = self._clip(work, grad_mult, device)
        found_inf = None if found_inf is None else found_inf.to(device, torch.float32).reshape(())
        for group, params in work:
            for bucket in self._buckets(params):
                self._step_bucket(group, bucket, [p.grad for p in bucket], grad_mult, found_inf)
        return loss

    @torch.no_grad()
    def step_grads(
        self, grads: dict[torch.Tensor, torch.Tensor], grad_mult: torch.Tensor | None, found_inf: torch.Tensor | None
    ) -> None:
        """One step whose grads are given, not read from .grad (GradientAccumulator's fused tail: its
        float32 buffers, possibly for 16-bit params): params absent from `grads` are not stepped,
        `grad_mult` is the whole multiplier (max_grad_norm is not applied: the caller clips)."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p in grads]
            for bucket in self._buckets(params):
                self._step_bucket(group, bucket, [grads[p] for p in bucket], grad_mult, found_inf)

    def _clip(self, work, grad_mult: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        """Folds min(1, max_norm / (norm + eps)) of the (unscaled) grads into grad_mult."""
        if self.max_grad_norm is None:
            return grad_mult
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for _, params in work:
            if any(is_sharded(p.grad) for p in params):
                raise ValueError(
                    f"{type(self).__name__}(max_grad_norm=...) cannot clip sharded (FSDP2 DTensor) gradients: its "
                    "norm would be this rank's shards' only; clip with GradientAccumulationConfig.max_grad_norm"
                )
            for p in params:
                by_device.setdefault(p.grad.device, []).append(p.grad)
        norms = [_norm_of(grads).to(device, torch.float32) for grads in by_device.values()]
        norm = combine_norms(norms, 2.0)
        if grad_mult is not None:
            norm = norm * grad_mult
        self.last_grad_norm = norm
        coef = torch.clamp(self.max_grad_norm / (norm + CLIP_EPS), max=1.0)
        return coef if grad_mult is None else grad_mult * coef

    def _buckets(self, params: list[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
        """One op call per device, with 16-bit params apart in master mode (only they have masters)."""
        buckets: dict[tuple[torch.device, bool], list[torch.Tensor]] = {}
        for p in params:
            low = self.param_mode == "master" and p.dtype in HALF_DTYPES
            buckets.setdefault((p.device, low), []).append(p)
        return buckets.values()

    def _step_bucket(self, group, params, grads, grad_mult, found_inf) -> None:
        masters, steps = [], []
        master_mode = self.param_mode == "master" and params[0].dtype in HALF_DTYPES
        for p in params:
            state = self.state[p]
            if "step" not in state:
                self._init_state(p, state)
            if master_mode and "master_param" not in state:
                state["master_param"] = p.detach().float()
            steps.append(state["step"])
            if master_mode:
                masters.append(state["master_param"])
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            lr = lr.to(params[0].device, torch.float32)
        kwargs = {
            "lr": lr,
            "grad_mult": grad_mult,
            "found_inf": found_inf,
            "maximize": bool(group["maximize"]),
            "mode": "master" if master_mode else ("stochastic" if self.param_mode == "stochastic" else "nearest"),
            "seed": self.seed,
            "backend": self.backend,
        }
        self._run_op(group, params, grads, steps, masters, kwargs)

    def _init_state(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def _run_op(self, group, params, grads, steps, masters, kwargs) -> None:
        raise NotImplementedError


def new_state(param: torch.Tensor) -> torch.Tensor:
    """A zero state tensor for `param`: float32, or float64 for a float64 param."""
    return torch.zeros_like(param, dtype=state_dtype(param.dtype), memory_format=torch.contiguous_format)


def new_step(param: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=param.device)
