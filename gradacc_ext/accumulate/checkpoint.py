"""Mid-window checkpointing: the open window's buffers, normaliser, counters and loss scale.

Save it with the model, optimizer and scheduler; loading it into an
accumulator built the same way resumes the window exactly where it was.
Checkpoint gathers the collaborators' state in the form the grad-sync strategy
checkpoints (FSDP2 and DDP: DTensors, for torch.distributed.checkpoint).
"""

from __future__ import annotations

from typing import Any

from ..distributed.base import LocalSync
from .buffers import GradBuffers
from .config import GradientAccumulationConfig
from .loss_scale import LossScale
from .stats import AccumulatorStats
from .stepper import OptimizerStepper
from .window import Window

# 3: + the deferred (fused) step's outcome, saved instead of resolved; 2: per-parameter sums
# (layout-free); 1: whole flat buffers. All still load.
STATE_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)


class Checkpoint:
    """Reads and restores the state of one accumulator's collaborators."""

    def __init__(
        self,
        config: GradientAccumulationConfig,
        window: Window,
        buffers: GradBuffers,
        stats: AccumulatorStats,
        loss_scale: LossScale | None,
        stepper: OptimizerStepper,
        sync: LocalSync,
    ) -> None:
        self.config = config
        self.window = window
        self.buffers = buffers
        self.stats = stats
        self.loss_scale = loss_scale
        self.stepper = stepper
        self.sync = sync

    def state_dict(self, replicated: bool = False) -> dict[str, Any]:
        """Changes nothing: a pending scheduler decision is saved as it is, never taken here.

        replicated: one state that is every rank's, for a framework that saves rank 0's file alone (Lightning):
        only at a window boundary, where no rank holds sums or items of its own (the counters, the loss scale
        and a deferred step's outcome are the same on every rank: each window closes on all of them together).
        """
        if replicated and self.window.micro:
            raise RuntimeError(
                "GradientAccumulator.state_dict(replicated=True): the open window holds this rank's own sums of "
                f"{self.window.micro} micro-step(s), which one state for every rank cannot hold; save at a window "
                "boundary, or save every rank's state (replicated=False, with torch.distributed.checkpoint)"
            )
        state = {
            "version": STATE_VERSION,
            "pending_step_skipped": self.stepper.pending_state(),
            "accumulation_steps": self.config.accumulation_steps,
            "loss_normalization": self.config.loss_normalization,
            **self.window.state_dict(),
            "buffers": self.buffers.state_dict(),
            "stats": self.stats.counters(),
            "loss_scale": self.loss_scale.state_dict() if self.loss_scale is not None else None,
        }
        if replicated:
            return {**state, "replicated": True}
        return self.sync.wrap_state(state, self.buffers)  # sharded and per-rank values as DTensors

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Checks everything before changing anything, so a rejected state leaves the accumulator as it was."""
        if not state.get("replicated"):
            state = self.sync.unwrap_state(state, self.buffers)
        if state.get("version") not in READABLE_VERSIONS:
            raise ValueError(
                f"GradientAccumulator.load_state_dict: unknown state version {state.get('version')!r}, "
                f"expected one of {READABLE_VERSIONS}"
            )
        for key in ("accumulation_steps", "loss_normalization"):
            mine = getattr(self.config, key)
            if state[key] != mine:
                raise ValueError(
                    f"GradientAccumulator.load_state_dict: the state was saved with {key}={state[key]!r}, "
                    f"this accumulator has {mine!r}"
                )
        if (state["loss_scale"] is None) != (self.loss_scale is None):
            raise ValueError(
                "GradientAccumulator.load_state_dict: the state and this accumulator disagree on fp16 loss scaling"
            )
        self.buffers.load_state_dict(state["buffers"])
        self.window.load_state_dict(state)
        self.stats.load_counters(state["stats"])
        if self.loss_scale is not None:
            self.loss_scale.load_state_dict(state["loss_scale"])
        self.stepper.restore(state.get("pending_step_skipped"))
