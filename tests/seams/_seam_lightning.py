"""The Lightning entry of the seam matrix: a manual-optimisation LightningModule whose training_step runs
the callback's accumulator (retrying a micro-batch after an OOM), in a Trainer on this rank; several ranks
use Lightning's "ddp" strategy inside the process group the harness already started."""

from __future__ import annotations

import torch
from _seam_cells import config_fields, make_model, make_optimizer, make_scheduler, mse, samples, shard, user_scaler
from _seam_entries import retry_on_oom
from _seam_table import Cell

PRECISION = {"fp32": "64-true", "bf16": "32-true", "fp16_own": "32-true"}  # the config's autocast; fp16_user below


def run_lightning(cell: Cell, rank: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Trains the cell through the callback; returns the trained network and its optimizer (compared)."""
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

    fields = config_fields(cell)
    if cell.precision == "fp16_user":  # Lightning's "16-mixed" autocasts and scales with the user's GradScaler
        from lightning.pytorch.plugins import MixedPrecision

        fields["mixed_precision"] = "no"
        precision = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=user_scaler(cell))]}
    else:
        precision = {"precision": PRECISION[cell.precision]}
    module = SeamModule()
    loader = torch.utils.data.DataLoader([shard(b, rank) for b in samples(cell, world)], batch_size=None)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        max_epochs=1,
        **precision,
        callbacks=[GradientAccumulatorCallback(GradientAccumulationConfig(**fields))],
        use_distributed_sampler=False,  # each rank's loader already holds its own shard
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    return module.net, trainer.optimizers[0]
