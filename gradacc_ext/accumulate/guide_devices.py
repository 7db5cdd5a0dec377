"""The guides' device and memory calls, as reports that work on any machine (gradacc_ext.compat exports
MemoryMonitor; GradientAccumulator.update_config(model, device_ids) returns device_report's).

Seed 000's update_config(model, device_ids) and seed 002's MemoryMonitor ask
about GPUs; on a machine without those GPUs (or without CUDA) they report
what is there instead of raising. Figures are CUDA allocator counters (host
reads, no device sync); without CUDA every GPU figure is 0.0 and `note`
says why.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from .stats import GB


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_memory(index: int) -> dict[str, float]:
    """Allocator counters of one visible CUDA device, in GB; total from its properties."""
    total = torch.cuda.get_device_properties(index).total_memory / GB
    allocated = torch.cuda.memory_allocated(index) / GB
    return {
        "memory_allocated": allocated,
        "memory_reserved": torch.cuda.memory_reserved(index) / GB,
        "max_memory_allocated": torch.cuda.max_memory_allocated(index) / GB,
        "total_memory": total,
        "gpu_utilization": allocated / total if total else 0.0,
    }


def device_report(device_ids: Sequence[int] | None) -> dict[str, Any]:
    """Which of the requested CUDA device ids exist here, and their memory; never raises for missing ones."""
    count = _cuda_count()
    requested = list(range(count)) if device_ids is None else [int(i) for i in device_ids]
    present = [i for i in requested if 0 <= i < count]
    missing = [i for i in requested if i not in present]
    report: dict[str, Any] = {
        "cuda_available": count > 0,
        "requested": requested,
        "available": present,
        "missing": missing,
        "memory": {i: device_memory(i) for i in present},
    }
    if missing:
        report["note"] = (
            f"CUDA devices {missing} are not present on this machine ({count} visible); "
            "the configuration is left unchanged"
        )
    return report


class MemoryMonitor:
    """Seed 002's monitor: memory usage of one CUDA device, its trend and recommendations.

    device: a CUDA device index (default: the current one). Every
    get_memory_usage() call is one sample of the trend (the last `history`).
    """

    def __init__(self, device: int | None = None, threshold: float = 0.8, history: int = 100) -> None:
        if not 0 < threshold <= 1:
            raise ValueError(f"MemoryMonitor: threshold must be in (0, 1], got {threshold!r}")
        self.threshold = threshold
        count = _cuda_count()
        self.device = (torch.cuda.current_device() if count else None) if device is None else int(device)
        self.samples: deque[float] = deque(maxlen=max(int(history), 2))

    def get_memory_usage(self) -> dict[str, Any]:
        count = _cuda_count()
        if self.device is not None and 0 <= self.device < count:
            usage: dict[str, Any] = {"device": f"cuda:{self.device}", **device_memory(self.device)}
        else:
            usage = dict.fromkeys(
                ("memory_allocated", "memory_reserved", "max_memory_allocated", "total_memory", "gpu_utilization"),
                0.0,
            )
            usage["device"] = None
            usage["note"] = (
                "no CUDA device on this machine: GPU figures are 0.0"
                if count == 0
                else f"CUDA device {self.device} is not present ({count} visible): GPU figures are 0.0"
            )
        self.samples.append(usage["memory_allocated"])
        return usage

    def get_memory_trend(self) -> dict[str, Any]:
        """'increasing', 'decreasing' or 'stable' over the samples taken (a 1% band), or 'unknown' before two."""
        if len(self.samples) < 2:
            return {"trend": "unknown", "samples": len(self.samples), "change_gb": 0.0}
        change = self.samples[-1] - self.samples[0]
        band = 0.01 * max(self.samples)
        trend = "increasing" if change > band else "decreasing" if change < -band else "stable"
        return {"trend": trend, "samples": len(self.samples), "change_gb": change}

    def get_memory_recommendations(self) -> list[str]:
        usage = self.get_memory_usage()
        if usage["device"] is None:
            return [usage["note"] + "; nothing to recommend about GPU memory"]
        if usage["gpu_utilization"] <= self.threshold:
            return []
        return [
            f"{usage['gpu_utilization']:.0%} of GPU memory is allocated (threshold {self.threshold:.0%}): lower the "
            "micro-batch and raise accumulation_steps by the same factor (the effective batch stays the same), "
            "use mixed_precision='bf16', or AdaptiveGradientAccumulator.step_batch to split on out-of-memory"
        ]
