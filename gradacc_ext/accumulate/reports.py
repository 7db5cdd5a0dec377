"""The stats dicts of the guides' entry points: accumulate_gradients() and get_accumulation_stats().

Values are host numbers or device tensors (formatting a tensor reads it);
get_accumulation_stats() reads the device-side norm history (one sync).
"""

from __future__ import annotations

from typing import Any

import torch

from .config import GradientAccumulationConfig
from .loss_scale import LossScale
from .stats import GB, AccumulatorStats
from .window import Window


class StatsReport:
    """Builds the dicts from the accumulator's collaborators."""

    def __init__(
        self,
        config: GradientAccumulationConfig,
        window: Window,
        stats: AccumulatorStats,
        loss_scale: LossScale | None,
        norm: torch.Tensor,
        device: torch.device,
    ) -> None:
        self.config = config
        self.window = window
        self.stats = stats
        self.loss_scale = loss_scale
        self.norm = norm
        self.device = device

    def scale_value(self) -> float | None:
        """The current fp16 loss scale (a host read), or None without fp16."""
        return None if self.loss_scale is None else float(self.loss_scale.tensor(self.device).item())

    def after_backward(self, closed: bool, loss: torch.Tensor, scaled: torch.Tensor | None) -> dict[str, Any]:
        steps = int(self.config.accumulation_steps)
        return {
            "should_update": closed,
            "should_step": closed,
            "accumulation_step": steps if closed else self.window.micro,
            "accumulation_steps": steps,
            "effective_batch_size": self.config.effective_batch_size,
            "original_loss": loss.detach(),
            "scaled_loss": scaled,
            "grad_norm": self.norm.reshape(()).clone() if closed else None,
            "loss_scale": self.loss_scale.tensor(self.device) if self.loss_scale is not None else None,
            "memory_used": torch.cuda.memory_allocated(self.device) / GB if self.device.type == "cuda" else 0.0,
            "micro_steps": self.stats.micro_steps,
            "windows": self.stats.windows,
        }

    def all_stats(self) -> dict[str, Any]:
        norms = self.stats.grad_norm_history()
        finite = norms[torch.isfinite(norms)]
        step_time = self.stats.mean_step_time()
        return {
            **self.stats.counters(),
            "current_step": self.stats.optimizer_steps,
            "accumulation_step": self.window.micro,
            "accumulation_steps": int(self.config.accumulation_steps),
            "effective_batch_size": self.config.effective_batch_size,
            "target_batch_size": self.config.target_batch_size,
            "loss_scale": self.scale_value(),
            "grad_norm_history": norms.tolist(),
            "last_gradient_norm": float(norms[-1]) if len(norms) else None,
            "avg_gradient_norm": float(finite.mean()) if len(finite) else None,
            "peak_memory_gb": self.stats.peak_memory_gb(),
            "memory_usage": list(self.stats.memory_usage),
            "fused_step": self.stats.fused_step,
            "fused_step_reason": self.stats.fused_step_reason,
            "fused_linear_params": self.stats.fused_linear_params,
            "linear_fusion_fallbacks": dict(self.stats.linear_fusion_fallbacks),
            "time_per_micro_step_s": self.stats.mean_micro_step_time(),
            "time_per_step_s": step_time,
            "avg_accumulation_time": step_time,
            "config": self.config.to_dict(),
        }


def check_same_objects(**pairs: tuple[object, object]) -> None:
    """accumulate_gradients(loss, model, optimizer, scaler): each given object must be the accumulator's own."""
    for name, (given, mine) in pairs.items():
        if given is not None and given is not mine:
            raise ValueError(
                f"GradientAccumulator.accumulate_gradients: the {name} passed is not the one this accumulator "
                "was built with"
            )
