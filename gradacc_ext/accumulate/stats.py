"""Accumulator statistics, recorded without host syncs and read on demand.

Counters and wall-clock times live on the host (Python ints and floats);
the per-step gradient norms stay on the device in a ring buffer and are
copied to the host only when asked for. Wall times are host times between
consecutive calls: on CUDA, without a sync, a single interval is the launch
time, but in steady state (the host throttled by the device queue) the mean
interval is the real time per micro-step / per step.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.hooks import RemovableHandle

GB = float(1 << 30)


@dataclass(frozen=True)
class StepInfo:
    """What a callback gets at the end of every window (device tensors: reading them syncs).

    step: windows closed so far (this one included); micro_steps: micro-batches
    in this window; grad_norm: the accumulated gradient's norm before clipping;
    found_inf: 1.0 if it held inf/NaN or its norm was not finite (the step was
    skipped with skip_nonfinite); loss_scale: the
    fp16 scale used in the window, else None; items: the window's normaliser
    (micro-batch or item count across ranks); time_s: host seconds since the
    previous window ended.
    """

    step: int
    micro_steps: int
    grad_norm: torch.Tensor
    found_inf: torch.Tensor
    loss_scale: torch.Tensor | None
    items: torch.Tensor
    time_s: float


@dataclass(frozen=True)
class WindowState:
    """GradientAccumulator.window_state(): read without a host sync (device tensors: reading them syncs).

    micro_steps: micro-batches in the open window; grad_norm: the last closed
    window's pre-clip norm (shape (1,), updated in place at every window end);
    loss_scale: the current fp16 scale, else None; scaler: the GradScaler in
    use, else None; last_loss: the last backpropagated loss as scaled (detached).
    """

    micro_steps: int
    grad_norm: torch.Tensor
    loss_scale: torch.Tensor | None
    scaler: torch.amp.GradScaler | None
    last_loss: torch.Tensor | None


class AccumulatorStats:
    """Counts micro-steps, windows, real and skipped optimizer steps; keeps norms, memory and timings."""

    def __init__(self, device: torch.device, history: int, track_memory: bool) -> None:
        self.device = device
        self.history = history
        self.track_memory = track_memory and device.type == "cuda"
        # An OrderedDict because RemovableHandle keeps a weak reference to it (a plain dict has none).
        self._callbacks: OrderedDict[int, Callable[[StepInfo], None]] = OrderedDict()
        self.fused_step = False  # whether windows end in the fused optimizer pass (set by WindowEnd) ...
        self.fused_step_reason = ""  # ... and why not
        self.fused_linear_params = 0  # parameters whose gradient nn.Linear writes into the buffers (linear_fusion.py)
        self.linear_fusion_fallbacks: dict[str, str] = {}  # parameter name -> why it is not fused
        self.reset()

    def reset(self) -> None:
        self.micro_steps = 0
        self.windows = 0
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self._norms = torch.full((self.history,), float("nan"), dtype=torch.float32, device=self.device)
        self._micro_time = [0.0, 0]  # sum of intervals, count
        self._step_time = [0.0, 0]
        self._last_micro = self._last_step = time.perf_counter()
        self.memory_usage: deque[dict] = deque(maxlen=max(self.history, 1))
        self.linear_fusion_unfused_calls: dict[str, int] = {}  # reason -> fused-Linear calls run as plain F.linear

    # -- recording (no host sync) -----------------------------------------------------------------------------------

    def micro_step(self) -> None:
        now = time.perf_counter()
        self._micro_time[0] += now - self._last_micro
        self._micro_time[1] += 1
        self._last_micro = now
        self.micro_steps += 1

    def window(
        self,
        micro_steps: int,
        grad_norm: torch.Tensor,
        found_inf: torch.Tensor,
        loss_scale: torch.Tensor | None,
        items: torch.Tensor,
    ) -> None:
        now = time.perf_counter()
        elapsed = now - self._last_step
        self._step_time[0] += elapsed
        self._step_time[1] += 1
        self._last_step = now
        if self.history:
            self._norms[self.windows % self.history].copy_(grad_norm.reshape(()))
        self.windows += 1
        if self.track_memory:
            self.memory_usage.append(
                {
                    "step": self.windows,
                    "allocated_gb": torch.cuda.memory_allocated(self.device) / GB,
                    "reserved_gb": torch.cuda.memory_reserved(self.device) / GB,
                    "peak_gb": torch.cuda.max_memory_allocated(self.device) / GB,
                }
            )
        if self._callbacks:
            info = StepInfo(self.windows, micro_steps, grad_norm.clone(), found_inf.clone(), loss_scale, items, elapsed)
            for callback in list(self._callbacks.values()):
                callback(info)

    def outcome(self, skipped: bool) -> None:
        if skipped:
            self.skipped_steps += 1
        else:
            self.optimizer_steps += 1

    def add_callback(self, callback: Callable[[StepInfo], None]) -> RemovableHandle:
        """Calls `callback(StepInfo)` after every window; returns a handle whose remove() unsubscribes."""
        if not callable(callback):
            raise TypeError(f"add_callback: callback must be callable, got {type(callback).__name__}")
        handle = RemovableHandle(self._callbacks)
        self._callbacks[handle.id] = callback
        return handle

    # -- reading (on demand; the norm history syncs) -----------------------------------------------------------------

    def grad_norm_history(self) -> torch.Tensor:
        """The last `history` pre-clip grad norms, oldest first, as a CPU float32 tensor."""
        kept = min(self.windows, self.history)
        if kept == 0:
            return torch.empty(0, dtype=torch.float32)
        start = self.windows % self.history if self.windows > self.history else 0
        return torch.roll(self._norms, -start)[:kept].cpu()

    def mean_micro_step_time(self) -> float | None:
        return self._micro_time[0] / self._micro_time[1] if self._micro_time[1] else None

    def mean_step_time(self) -> float | None:
        return self._step_time[0] / self._step_time[1] if self._step_time[1] else None

    def peak_memory_gb(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.device) / GB if self.track_memory else None

    def counters(self) -> dict[str, int]:
        return {
            "micro_steps": self.micro_steps,
            "windows": self.windows,
            "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_counters(self, counters: dict[str, int]) -> None:
        self.micro_steps = int(counters["micro_steps"])
        self.windows = int(counters["windows"])
        self.optimizer_steps = int(counters["optimizer_steps"])
        self.skipped_steps = int(counters["skipped_steps"])
