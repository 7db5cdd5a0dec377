"""The Lightning entry of the seam matrix: a manual-optimisation LightningModule whose training_step runs
the callback's accumulator (retrying a micro-batch after an OOM), in a Trainer on this rank; several ranks
use Lightning's "ddp" strategy inside the process group the harness already started.

A "checkpoint" cell saves the way a Lightning user does mid-epoch: trainer.save_checkpoint() from a callback's
on_train_batch_end after CHECKPOINT_AT micro-batches (the window open), then stops; phase "resume" fits a fresh
Trainer from that file (ckpt_path), which restores the loop, the loader's position, the module, the optimizer,
the scheduler, the precision plugin's scaler and the callback's accumulator, open window included."""

from __future__ import annotations

import os

import torch
from _seam_cells import (
    CHECKPOINT_AT,
    config_fields,
    make_model,
    make_optimizer,
    make_scheduler,
    mse,
    samples,
    shard,
    user_scaler,
)
from _seam_entries import retry_on_oom
from _seam_table import Cell

PRECISION = {"fp32": "64-true", "bf16": "32-true", "fp16_own": "32-true"}  # the config's autocast; fp16_user below


class ResumableBatches:
    """This rank's micro-batches as a loader Lightning can resume mid-epoch (state_dict / load_state_dict: how many
    it has handed out). It has a length, so Lightning fetches no batch ahead and the count is the trained one."""

    def __init__(self, batches: list) -> None:
        self.batches, self.served = batches, 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        while self.served < len(self.batches):
            self.served += 1
            yield self.batches[self.served - 1]
        self.served = 0  # the next epoch starts from the first batch

    def state_dict(self) -> dict:
        return {"served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.served = state["served"]


def run_lightning(
    cell: Cell, rank: int, world: int, phase: str, ckpt: str
) -> tuple[torch.nn.Module, torch.optim.Optimizer, bool]:
    """Trains the cell through the callback; returns the trained network and its optimizer (compared), and False
    when phase "save" stopped after writing its checkpoint."""
    import lightning.pytorch as pl

    from gradacc_ext import GradientAccumulationConfig
    from gradacc_ext.integrations.lightning import GradientAccumulatorCallback

    class SeamModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(cell, rank)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            acc = self.accumulator

            def step() -> None:
                with acc.micro_step():
                    acc.backward(mse(self.net, batch))

            retry_on_oom(step)

        def configure_optimizers(self):
            opt = make_optimizer(cell, self.parameters())
            return {"optimizer": opt, "lr_scheduler": make_scheduler(opt)}

    path = os.path.join(ckpt, "lightning.ckpt")

    class SaveMidWindow(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
            if trainer.fit_loop.epoch_loop.batch_progress.current.processed == CHECKPOINT_AT:
                trainer.save_checkpoint(path)  # refused under DDP: each rank's open window is its own
                trainer.should_stop = True

    fields = config_fields(cell)
    if cell.precision == "fp16_user":  # Lightning's "16-mixed" autocasts and scales with the user's GradScaler
        from lightning.pytorch.plugins import MixedPrecision

        fields["mixed_precision"] = "no"
        precision = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=user_scaler(cell))]}
    else:
        precision = {"precision": PRECISION[cell.precision]}
    module = SeamModule()
    loader = ResumableBatches([shard(b, rank) for b in samples(cell, world)])
    accumulate = GradientAccumulatorCallback(GradientAccumulationConfig(**fields))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        max_epochs=1,
        **precision,
        callbacks=[accumulate, SaveMidWindow()] if phase == "save" else [accumulate],
        use_distributed_sampler=False,  # each rank's loader already holds its own shard
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader, ckpt_path=path if phase == "resume" else None)
    return module.net, trainer.optimizers[0], phase != "save"
