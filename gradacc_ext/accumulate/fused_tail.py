"""The window's tail as one fused optimizer pass (config.fused_step).

The plain tail reads the buffers four times after the last backward: unscale (and the inf check),
norm, clip, then optimizer.step() (plus a param-dtype copy of every 16-bit param's gradient).
The fused tail reads them twice: one read-only norm pass, whose non-finite result is found_inf,
then gradacc's adamw_step_/sgd_step_, whose grad multiplier (loss-scale inverse x normaliser x
clip coefficient) is computed on the device. Nothing syncs the host, and 16-bit params read
their float32 buffers directly.

It steps the user's own optimizer: its param_groups (lr read at every step, so schedulers work)
and its state tensors, in torch's format, so optimizer.state_dict() stays valid either way.
Under FSDP2 and HSDP the pass runs on each rank's local shards (of the params, of the buffers,
which mirror them, and of torch's DTensor state, which stays a DTensor for checkpoints), with the
norm and found_inf that the strategy's global_norm made global: every rank clips alike and skips alike.
Two tails stay passes: clip_value (an element-wise clamp of the unscaled gradient), and float64
buffers (the op's grad multiplier is float32; float64 models apply it in float64 first).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.optim.optimizer as optimizer_module

from ..ops import DEFAULT_EPS, adamw_step_, sgd_step_
from ..optim import FusedAdamW, FusedSGD
from ..optim._shards import on_local_shards
from .buffers import GradBuffers
from .config import GradientAccumulationConfig

log = logging.getLogger("gradacc_ext")


def unsupported_reason(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> str | None:
    """Why `optimizer` cannot take the fused step over `params` (None: it can)."""
    name = type(optimizer).__name__
    hooks = optimizer_module._global_optimizer_pre_hooks, optimizer_module._global_optimizer_post_hooks
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks or any(hooks):
        return "optimizer step hooks are registered (the fused pass does not call optimizer.step())"
    if isinstance(optimizer, (FusedAdamW, FusedSGD)):
        if optimizer.max_grad_norm is not None:
            return f"{name}(max_grad_norm=...) clips inside its own step; set the config's max_grad_norm instead"
        return None
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
        return f"{name} is not FusedAdamW, FusedSGD, or torch.optim.AdamW / Adam / SGD"
    low = sorted({str(p.dtype) for p in params if p.dtype in (torch.float16, torch.bfloat16)})
    if low:
        return f"torch.optim.{name} keeps its state in the param dtype ({', '.join(low)}); use gradacc's Fused{name}"
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            return f"torch.optim.{name}(differentiable=True)"
        adam_l2 = type(optimizer) is torch.optim.Adam and not group.get("decoupled_weight_decay", False)
        if adam_l2 and group["weight_decay"] != 0:
            return "torch.optim.Adam with weight_decay adds it to the gradient (L2), not decoupled (AdamW)"
    return None


class FusedTail:
    """Steps the optimizer from the buffers in one fused pass per param group."""

    def __init__(self, optimizer: torch.optim.Optimizer, buffers: GradBuffers) -> None:
        self.optimizer = optimizer
        self.buffers = buffers
        self.index = {p: i for i, p in enumerate(buffers.params)}
        self.calls = 0  # fused op calls made (observable: tests and stats)
        self._sgd_steps: dict[torch.Tensor, tuple[torch.Tensor | None, torch.Tensor]] = {}

    @classmethod
    def choose(
        cls, mode: bool | str, optimizer: torch.optim.Optimizer, buffers: GradBuffers
    ) -> tuple[FusedTail | None, str]:
        """(the tail or None, why not); mode True with an unsupported optimizer raises."""
        if mode is False:
            return None, "config.fused_step=False"
        why = unsupported_reason(optimizer, buffers.params)
        if why is None:
            return cls(optimizer, buffers), ""
        if mode is True:
            raise ValueError(f"GradientAccumulationConfig.fused_step=True, but the optimizer cannot take it: {why}")
        log.info("GradientAccumulator: fused_step='auto' falls back to optimizer.step(): %s", why)
        return None, why

    # -- the window's multiplier -------------------------------------------------------------------------------------

    def finish(
        self,
        config: GradientAccumulationConfig,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        norm_out: torch.Tensor,
        combine: Callable[[torch.Tensor, torch.Tensor, float], None],
    ) -> torch.Tensor | None:
        """Norm and found_inf of the window (`combine` makes them global across shards); returns the
        step's grad multiplier, or None when the passes below already applied it."""
        b, c = self.buffers, config
        if c.clip_value is not None or norm_out.dtype == torch.float64:
            b.finish(inv_scale, found_inf, norm_out, c.norm_type)
            combine(norm_out, found_inf, c.norm_type)
            b.clip(norm_out, c.max_grad_norm, c.clip_value)
            return None
        raw = b.ops.global_norm(b.window_views(), c.norm_type, backend=b.backend).reshape(1)
        norm_out.copy_(raw * inv_scale)  # the unscaled gradient's norm, as the plain tail records it
        found_inf.copy_((~torch.isfinite(raw)).reshape(found_inf.shape))
        combine(norm_out, found_inf, c.norm_type)
        mult = inv_scale
        if c.max_grad_norm is not None:
            mult = mult * torch.clamp(c.max_grad_norm / (norm_out + DEFAULT_EPS), max=1.0)
        return mult.reshape(()).to(torch.float32)

    # -- the step ----------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, grad_mult: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """One fused step of every param group over the window's gradients."""
        b = self.buffers
        grads = {p: b.views[i] for p, i in self.index.items() if b.seen[i]}
        opt = self.optimizer
        # What torch's LR schedulers' wrapper of optimizer.step() records: a step was taken, so a
        # scheduler step after it is in the right order (no "lr_scheduler.step() before" warning).
        opt._opt_called = True
        if isinstance(opt, (FusedAdamW, FusedSGD)):
            opt.step_grads(grads, grad_mult, found_inf)
            self.calls += 1
            return
        for group in opt.param_groups:
            params = [p for p in group["params"] if p in grads]
            if params:
                kwargs = {"lr": _lr(group, params[0]), "grad_mult": grad_mult, "found_inf": found_inf}
                run = self._sgd if isinstance(opt, torch.optim.SGD) else self._adam
                run(group, params, [grads[p] for p in params], kwargs)
                self.calls += 1

    def _adam(self, group: dict, params: list, grads: list, kwargs: dict) -> None:
        states = [self.optimizer.state[p] for p in params]
        for p, state in zip(params, states, strict=True):
            if "step" not in state:  # torch's lazy state, as Adam._init_group creates it
                state["step"] = torch.tensor(0.0, dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"] and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] = _step_tensor(state["step"], p)
        beta1, beta2 = group["betas"]
        on_local_shards(adamw_step_)(
            params,
            grads,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["step"] for s in states],
            betas=(float(beta1), float(beta2)),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            max_exp_avg_sqs=[s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else [],
            maximize=bool(group["maximize"]),
            backend=self.buffers.backend,
            **kwargs,
        )

    def _sgd(self, group: dict, params: list, grads: list, kwargs: dict) -> None:
        buffers, steps = [], []
        if group["momentum"] != 0:
            for p in params:
                state = self.optimizer.state[p]
                buf = state.get("momentum_buffer")
                known, step = self._sgd_steps.get(p, (None, None))
                if step is None or known is not buf:
                    # torch.optim.SGD has no step count: a buffer it made (or loaded) is past its first step.
                    step = torch.tensor(0.0 if buf is None else 1.0, dtype=torch.float32, device=p.device)
                if buf is None:
                    buf = state["momentum_buffer"] = torch.zeros_like(p)  # the first real step overwrites it
                self._sgd_steps[p] = (buf, step)
                buffers.append(buf)
                steps.append(step)
        on_local_shards(sgd_step_)(
            params,
            grads,
            momentum=float(group["momentum"]),
            dampening=float(group["dampening"]),
            weight_decay=float(group["weight_decay"]),
            nesterov=bool(group["nesterov"]),
            momentum_buffers=buffers,
            steps=steps,
            maximize=bool(group["maximize"]),
            backend=self.buffers.backend,
            **kwargs,
        )


def _lr(group: dict, param: torch.Tensor) -> float | torch.Tensor:
    lr = group["lr"]
    return lr.to(param.device, torch.float32) if isinstance(lr, torch.Tensor) else float(lr)


def _step_tensor(step: torch.Tensor | float, param: torch.Tensor) -> torch.Tensor:
    """torch's step count as the op takes it: float32 on the param's device (as torch's fused Adam keeps it)."""
    if isinstance(step, torch.Tensor) and step.dtype == torch.float32 and step.device == param.device:
        return step
    value = step if isinstance(step, torch.Tensor) else torch.tensor(float(step))
    return value.to(device=param.device, dtype=torch.float32).reshape(())
