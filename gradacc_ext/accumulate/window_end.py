"""The end of a window: reduce across ranks, normalise and unscale, check, clip, step, start afresh.

The buffers hold a SUM; the window's normaliser and the fp16 loss scale are
applied once, as the device tensor inv_scale = 1 / (loss_scale * normaliser),
in one final pass over the window's views (unscale, inf check, norm) after
the last micro-step's backward has folded its gradients. Clipping then acts on the fully accumulated, unscaled
gradient, and the optimizer sees the buffers as param.grad. With a FusedTail (config.fused_step) the
unscale and clip passes fold into the fused optimizer pass instead (see fused_tail.py).
"""

from __future__ import annotations

import torch

from ..distributed.grad_sync import LocalSync
from .buffers import GradBuffers
from .config import GradientAccumulationConfig
from .fused_tail import FusedTail
from .loss_scale import LossScale
from .stats import AccumulatorStats
from .stepper import OptimizerStepper
from .window import Window


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
        self.tail, why = FusedTail.choose(config.fused_step, stepper.optimizer, buffers)
        stats.fused_step, stats.fused_step_reason = self.tail is not None, why
        self.loss_scale, self.stepper, self.stats = loss_scale, stepper, stats
        self.device = buffers.device
        self.scalar_dtype = torch.float64 if torch.float64 in buffers.dtypes else torch.float32
        self.found_inf = torch.zeros((), dtype=torch.float32, device=self.device)  # 0-d, as fused steps expect
        self.norm = torch.zeros(1, dtype=self.scalar_dtype, device=self.device)

    def _inv_scale(self, count: torch.Tensor) -> torch.Tensor:
        denominator = count
        if self.loss_scale is not None:
            denominator = denominator * self.loss_scale.tensor(self.device).to(torch.float64).reshape(1)
        return (1.0 / denominator).to(self.scalar_dtype)

    def _global_norm(self, norm: torch.Tensor, found_inf: torch.Tensor, norm_type: float) -> None:
        """The window's norm and found_inf across shards; a non-finite norm sets found_inf, in both tails.

        A norm past the float range from finite values (fp32 L2: >= 2**64) would clip by 0, as in torch:
        a step that applies none of the gradient but still moves the params by momentum and weight decay.
        It is skipped instead, like an inf/NaN element (skip_nonfinite; README "The fused window tail").
        """
        self.sync.global_norm(norm, found_inf, norm_type)  # sharded buffers: norm across shards
        found_inf.copy_(found_inf.logical_or(~norm.isfinite().reshape(found_inf.shape)))

    def close(self, window: Window) -> None:
        """Applies `window` (its gradients all folded into the buffers) and starts the next one."""
        c, b = self.config, self.buffers
        self.sync.before_finish()
        self.found_inf.zero_()
        count = window.count()
        if self.sync.reduces:
            self.sync.reduce(b, count)
        inv_scale = self._inv_scale(count)
        scale = self.loss_scale.tensor(self.device).clone() if self.loss_scale is not None else None
        if self.tail is not None:
            mult = self.tail.finish(c, inv_scale, self.found_inf, self.norm, self._global_norm)
            self.stepper.step(self.found_inf, run=lambda found_inf: self.tail.step(mult, found_inf))
        else:
            b.finish(inv_scale, self.found_inf, self.norm, c.norm_type)
            self._global_norm(self.norm, self.found_inf, c.norm_type)
            b.clip(self.norm, c.max_grad_norm, c.clip_value)
            b.expose()
            self.stepper.step(self.found_inf)
        if self.loss_scale is not None:
            self.loss_scale.update(self.found_inf)
        b.release()
        micro = window.micro
        window.reset()
        self.stats.window(micro, self.norm, self.found_inf, scale, count)
