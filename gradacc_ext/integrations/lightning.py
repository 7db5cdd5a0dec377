"""GradientAccumulator inside a PyTorch Lightning Trainer (imports lightning.pytorch).

Lightning's own `accumulate_grad_batches` keeps the window's gradient in `.grad` and steps through
its loop; this callback instead gives a manual-optimisation LightningModule an accumulator over the
optimizer and scheduler from `configure_optimizers`, so the window runs in our buffers and closes with
the fused tail. The module's training_step runs `with self.accumulator.micro_step(): ...
self.accumulator.backward(loss)`; the callback closes a short last window at each epoch's end (weighted
by its real size), counts each closed window as one `trainer.global_step` (so max_steps and
step-based checkpointing work) and saves the accumulator's state in Lightning's checkpoints.

Strategies and precisions (lightning_setup.py): single device and Lightning's DDP (the accumulator is built over
the DistributedDataParallel wrapper, so the window's sums are all-reduced at its end); any other strategy is
refused at fit start. "16-mixed" scales with Lightning's GradScaler. A fit that raised closes the accumulator
(on_exception), so the callback can fit again.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from ..accumulate import GradientAccumulationConfig, GradientAccumulator
from .lightning_setup import accumulated_model, lightning_scaler


class GradientAccumulatorCallback(pl.Callback):
    """Attaches a GradientAccumulator built from `config` to the LightningModule as `attribute`."""

    def __init__(self, config: GradientAccumulationConfig, attribute: str = "accumulator") -> None:
        if not isinstance(config, GradientAccumulationConfig):
            raise TypeError(f"GradientAccumulatorCallback: config must be a GradientAccumulationConfig, got {config!r}")
        self.config = config
        self.attribute = attribute
        self.accumulator: GradientAccumulator | None = None
        self._pending_state: dict[str, Any] | None = None
        self._windows_counted = 0
        self._ranks = 1  # Lightning saves rank 0's checkpoint alone: with more, the state must be every rank's

    @property
    def state_key(self) -> str:
        return f"GradientAccumulatorCallback[{self.attribute}]"

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = accumulated_model(trainer, pl_module, self.config)  # refuses an unsupported strategy first
        scaler = lightning_scaler(trainer, self.config)
        if pl_module.automatic_optimization:
            raise ValueError(
                "GradientAccumulatorCallback needs manual optimisation: set self.automatic_optimization = False "
                "in the LightningModule (the accumulator steps the optimizer; Lightning itself then refuses "
                "Trainer(accumulate_grad_batches=...), which would accumulate twice)"
            )
        if len(trainer.optimizers) != 1 or len(trainer.lr_scheduler_configs) > 1:
            raise ValueError(
                "GradientAccumulatorCallback: configure_optimizers must return one optimizer and at most one "
                f"scheduler, got {len(trainer.optimizers)} and {len(trainer.lr_scheduler_configs)}"
            )
        scheduler = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
        self.accumulator = GradientAccumulator(model, trainer.optimizers[0], self.config, scheduler, scaler)
        if self._pending_state is not None:
            self.accumulator.load_state_dict(self._pending_state)
            self._pending_state = None
        self._windows_counted = self._windows()
        self._ranks = trainer.world_size
        setattr(pl_module, self.attribute, self.accumulator)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._count_windows(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.accumulator is not None:
            self.accumulator.flush()
            self._count_windows(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.accumulator is not None:
            self.accumulator.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # on_fit_end does not run after a fit that raised: without this the parameters stay owned by this
        # accumulator's hooks and the next fit's accumulator is refused. A state restored from a checkpoint
        # that the failed fit never loaded must not reach the next fit either.
        if self.accumulator is not None:
            self.accumulator.close()
        self._pending_state = None

    def state_dict(self) -> dict[str, Any]:
        if self.accumulator is None:
            return {}
        try:  # under DDP: one plain state, the same on every rank (at a window boundary), in rank 0's file
            return {"accumulator": self.accumulator.state_dict(replicated=self._ranks > 1)}
        except RuntimeError as error:
            raise RuntimeError(
                f"GradientAccumulatorCallback: Lightning saves rank 0's checkpoint alone, and with {self._ranks} "
                "ranks an open window's sums are each rank's own; checkpoint at a window boundary (a ModelCheckpoint "
                "with every_n_train_steps counts windows; the epoch's end closes the last one; validation in the "
                "middle of a window does not). " + str(error)
            ) from error

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks before on_fit_start builds the accumulator.
        if "accumulator" in state_dict:
            if self.accumulator is None:
                self._pending_state = state_dict["accumulator"]
            else:
                self.accumulator.load_state_dict(state_dict["accumulator"])

    def _windows(self) -> int:
        acc = self.accumulator
        return 0 if acc is None else acc.optimizer_steps + acc.skipped_steps

    def _count_windows(self, trainer: pl.Trainer) -> None:
        """Reports each closed window to Lightning's manual-optimisation loop as one optimizer step
        (what LightningOptimizer.step() would count): trainer.global_step reads that progress."""
        closed = self._windows() - self._windows_counted
        progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        for _ in range(max(closed, 0)):
            progress.increment_ready()
            progress.increment_completed()
        self._windows_counted += max(closed, 0)
