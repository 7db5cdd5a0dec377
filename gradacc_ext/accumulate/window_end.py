"""The end of a window, as one sequence: reduce, norm and found_inf, multiplier, step, scale update, release.

The buffers hold a SUM; the window's normaliser and the fp16 loss scale are applied once, as the
device tensor inv_scale = 1 / (loss_scale * normaliser), after the last micro-step's backward has
folded its gradients. Clipping acts on the fully accumulated, unscaled gradient.

Two ways through the same sequence:
  fused (config.fused_step, gradacc_ext.optim.fused_step_for): the norm of the sums as they stand,
    then ONE optimizer pass whose grad_mult = inv_scale x clip coefficient is a device scalar: no
    unscale pass, no clip pass, no param.grad, no host sync. Where the window's last fold writes the final
    sums (one process; FSDP2/HSDP, which reduce inside the closing backward, on their shards) and the norm
    type is 2 or inf, that fold gathered the norm's partials as it wrote the sums (fold_norm.py): only the
    views it did not write take a read-only norm pass, so the step reads each buffer once. Elsewhere
    (another order; DDP: the sums are final only after the window's all-reduce; a flush()ed window whose
    last fold did not know it was last) the norm is a read-only pass over the sums;
  separate passes (any other optimizer, clip_value, float64 buffers): unscale and norm in one pass,
    clip in place, then param.grad = the buffers and optimizer.step() (or, where the optimizer takes the
    fused step, that step with no multiplier).
"""

from __future__ import annotations

import logging

import torch

from ..distributed.base import LocalSync
from ..ops.constants import DEFAULT_EPS
from ..optim.fused_step import FusedStep, fused_step_for
from .buffers import GradBuffers
from .config import GradientAccumulationConfig
from .fold_norm import FOLD_NORM_TYPES
from .loss_scale import LossScale
from .stats import AccumulatorStats
from .stepper import OptimizerStepper
from .window import Window

log = logging.getLogger("gradacc_ext")


class WindowEnd:
    """Closes windows: owns the window's found_inf flag and grad norm (device tensors)."""

    def __init__(
        self,
        config: GradientAccumulationConfig,
        buffers: GradBuffers,
        sync: LocalSync,
        loss_scale: LossScale | None,
        stepper: OptimizerStepper,
        stats: AccumulatorStats,
    ) -> None:
        self.config, self.buffers, self.sync = config, buffers, sync
        self.tail, why = choose_fused_step(config.fused_step, stepper.optimizer, buffers)
        stats.fused_step, stats.fused_step_reason = self.tail is not None, why
        self.loss_scale, self.stepper, self.stats = loss_scale, stepper, stats
        self.device = buffers.device
        self.scalar_dtype = torch.float64 if torch.float64 in buffers.dtypes else torch.float32
        self.found_inf = torch.zeros((), dtype=torch.float32, device=self.device)  # 0-d, as fused steps expect
        self.norm = torch.zeros(1, dtype=self.scalar_dtype, device=self.device)
        # clip_value clamps the unscaled elements, and the op's grad_mult is fp32: float64 buffers are unscaled
        # and clipped in float64 first (~1e-12 agreement), then stepped with no multiplier.
        self.separate_passes = self.tail is None or config.clip_value is not None or self.scalar_dtype == torch.float64
        # The last fold gathers the norm where the sums are final at that fold: one process and FSDP2/HSDP (DDP
        # reduces the sums after it; distributed/*.py, sums_final_at_last_fold), and the fused step (the separate
        # passes unscale first).
        if not self.separate_passes and sync.sums_final_at_last_fold and config.norm_type in FOLD_NORM_TYPES:
            buffers.sums.fold_norm_type = float(config.norm_type)

    def close(self, window: Window) -> None:
        """Applies `window` (its gradients all folded into the buffers) and starts the next one."""
        c, b = self.config, self.buffers
        # 1. reduce: the buffers and the window's normaliser become sums over ranks
        self.sync.before_finish()
        count = window.count()
        if self.sync.reduces:
            self.sync.reduce(b, count)
        inv_scale = self._inv_scale(count)
        scale = self.loss_scale.tensor(self.device).clone() if self.loss_scale is not None else None
        # 2. norm and found_inf of the unscaled gradient, global across shards
        self.found_inf.zero_()
        if self.separate_passes:
            b.unscale_and_norm(inv_scale, self.found_inf, self.norm, c.norm_type)
        else:  # read-only: the sums stay scaled, the norm and the flag are the unscaled gradient's
            fold = b.sums.last_fold()
            raw = (b.norm(c.norm_type) if fold is None else b.norm_after_fold(fold)).reshape(1)
            self.norm.copy_(raw * inv_scale)
            nonfinite = ~torch.isfinite(raw) if fold is None else (~torch.isfinite(raw)) | (fold.found_inf != 0)
            self.found_inf.copy_(nonfinite.reshape(self.found_inf.shape))
        self.sync.global_norm(self.norm, self.found_inf, c.norm_type)  # sharded buffers: norm across shards
        self._skip_nonfinite_norm()
        # 3. the multiplier: scale^-1 x normaliser x clip (applied here, or folded into the fused step)
        if self.separate_passes:
            b.clip(self.norm, c.max_grad_norm, c.clip_value)
            grad_mult = None
        else:
            grad_mult = inv_scale
            if c.max_grad_norm is not None:
                grad_mult = grad_mult * clip_coefficient(self.norm, c.max_grad_norm)
            grad_mult = grad_mult.reshape(()).to(torch.float32)
        # 4. the step: fused over the buffers, or optimizer.step() over param.grad
        if self.tail is not None:
            self.stepper.step_fused(self.tail, b.grads_by_param(), grad_mult, self.found_inf)
        else:
            b.expose()
            self.stepper.step(self.found_inf)
        # 5. the loss scale's growth or backoff, on the device
        if self.loss_scale is not None:
            self.loss_scale.update(self.found_inf)
        # 6. release: the buffers' contents become stale, the window starts afresh
        b.release()
        micro = window.micro
        window.reset()
        self.stats.window(micro, self.norm, self.found_inf, scale, count)

    def _inv_scale(self, count: torch.Tensor) -> torch.Tensor:
        denominator = count
        if self.loss_scale is not None:
            denominator = denominator * self.loss_scale.tensor(self.device).to(torch.float64).reshape(1)
        return (1.0 / denominator).to(self.scalar_dtype)

    def _skip_nonfinite_norm(self) -> None:
        """A non-finite norm sets found_inf, in both ways through.

        A norm past the float range from finite values (fp32 L2: >= 2**64) would clip by 0, as in torch:
        a step that applies none of the gradient but still moves the params by momentum and weight decay.
        It is skipped instead, like an inf/NaN element (skip_nonfinite; docs/optimizers.md, "A norm past the
        float range").
        """
        self.found_inf.copy_(self.found_inf.logical_or(~self.norm.isfinite().reshape(self.found_inf.shape)))


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + eps)), torch.nn.utils.clip_grad_norm_'s coefficient, on the device."""
    return torch.clamp(max_norm / (norm + DEFAULT_EPS), max=1.0)


def choose_fused_step(
    mode: bool | str, optimizer: torch.optim.Optimizer, buffers: GradBuffers
) -> tuple[FusedStep | None, str]:
    """(the fused step or None, why not); config.fused_step=True with an optimizer that cannot take it raises."""
    if mode is False:
        return None, "config.fused_step=False"
    step = fused_step_for(optimizer, buffers.params, buffers.backend)
    if not isinstance(step, str):
        return step, ""
    if mode is True:
        raise ValueError(f"GradientAccumulationConfig.fused_step=True, but the optimizer cannot take it: {step}")
    log.info("GradientAccumulator: fused_step='auto' falls back to optimizer.step(): %s", step)
    return None, step
