"""The stats dicts of the guides' entry points: accumulate_gradients() and get_accumulation_stats().

Built from the accumulator's public read side (reads.py: counters, stats, window_state()), under
gradacc_ext's names and the ones the guides read (total_gradients, performance_metrics, ...). Values are host
numbers or device tensors (formatting a tensor reads it); get_accumulation_stats() reads the
device-side norm history (one sync).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..optim.state_storage import state_fallback_report, state_storage_report
from .stats import GB

if TYPE_CHECKING:  # the accumulator calls these; they only read it
    from .accumulator import GradientAccumulator


def after_backward(acc: GradientAccumulator, closed: bool, loss: torch.Tensor) -> dict[str, Any]:
    """accumulate_gradients()'s dict: what the micro-batch just backpropagated did to the window."""
    steps = int(acc.config.accumulation_steps)
    window = acc.window_state()
    return {
        "should_update": closed,
        "should_step": closed,
        "accumulation_step": steps if closed else window.micro_steps,
        "accumulation_steps": steps,
        "effective_batch_size": acc.config.effective_batch_size,
        "original_loss": loss.detach(),
        "scaled_loss": window.last_loss,
        "grad_norm": window.grad_norm.reshape(()).clone() if closed else None,
        "loss_scale": window.loss_scale,
        "memory_used": torch.cuda.memory_allocated(acc.device) / GB if acc.device.type == "cuda" else 0.0,
        "micro_steps": acc.stats.micro_steps,
        "windows": acc.stats.windows,
    }


def all_stats(acc: GradientAccumulator) -> dict[str, Any]:
    """get_accumulation_stats()'s dict: every statistic as host values."""
    acc.synchronize()
    stats, config = acc.stats, acc.config
    norms = stats.grad_norm_history()
    finite = norms[torch.isfinite(norms)]
    step_time, micro_time = stats.mean_step_time(), stats.mean_micro_step_time()
    memory = [m["allocated_gb"] for m in stats.memory_usage]
    return {
        **stats.counters(),
        "current_step": stats.optimizer_steps,
        "accumulation_step": acc.micro_steps_in_window,
        "accumulation_steps": int(config.accumulation_steps),
        "effective_batch_size": config.effective_batch_size,
        "target_batch_size": config.target_batch_size,
        "loss_scale": acc.loss_scale(),
        "grad_norm_history": norms.tolist(),
        "last_gradient_norm": float(norms[-1]) if len(norms) else None,
        "avg_gradient_norm": float(finite.mean()) if len(finite) else None,
        "peak_memory_gb": stats.peak_memory_gb(),
        "memory_usage": list(stats.memory_usage),
        "fused_step": stats.fused_step,
        "fused_step_reason": stats.fused_step_reason,
        "fused_linear_params": stats.fused_linear_params,
        "optimizer_state_storage": state_storage_report(acc.optimizer),
        "optimizer_state_fallbacks": state_fallback_report(acc.optimizer),
        "linear_fusion_fallbacks": dict(stats.linear_fusion_fallbacks),
        "linear_fusion_unfused_calls": dict(stats.linear_fusion_unfused_calls),
        "time_per_micro_step_s": micro_time,
        "time_per_step_s": step_time,
        "config": config.to_dict(),
        # the guides' names
        "total_gradients": stats.micro_steps,
        "avg_memory_usage_gb": sum(memory) / len(memory) if memory else 0.0,
        "avg_accumulation_time": step_time,
        "performance_metrics": {"time_per_step_s": step_time, "time_per_micro_step_s": micro_time},
    }


def check_same_objects(**pairs: tuple[object, object]) -> None:
    """accumulate_gradients(loss, model, optimizer, scaler): each given object must be the accumulator's own."""
    for name, (given, mine) in pairs.items():
        if given is not None and given is not mine:
            raise ValueError(
                f"GradientAccumulator.accumulate_gradients: the {name} passed is not the one this accumulator "
                "was built with"
            )
