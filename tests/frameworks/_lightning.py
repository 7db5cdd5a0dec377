"""The LightningModules and Trainer settings the Lightning tests share (import after importorskip("lightning"))."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from _common import ACCUM, params_of, regression_data, tiny_mlp

import gradacc_ext.utils
from gradacc_ext.optim import FusedAdamW

BATCHES = 3 * ACCUM  # three optimizer steps


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 2)


class Regressor(pl.LightningModule):
    """An MLP whose optimizer is torch's AdamW or FusedAdamW; `our_clip` replaces Lightning's
    clipping with gradacc_ext.utils.clip_grad_norm_ through Lightning's own clipping hook. `loss_factor`
    multiplies the loss (a small one puts unscaled fp16 gradients among the subnormals); `state_dtype` is
    FusedAdamW's (every tensor quantized with "int8")."""

    def __init__(
        self,
        fused: bool,
        our_clip: bool = False,
        max_grad_norm: float | None = None,
        loss_factor: float = 1.0,
        state_dtype: str = "fp32",
    ) -> None:
        super().__init__()
        self.net = tiny_mlp()
        self.fused, self.our_clip, self.max_grad_norm = fused, our_clip, max_grad_norm
        self.loss_factor, self.state_dtype = loss_factor, state_dtype

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss_factor * torch.nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        kwargs = {"lr": 3e-2, "weight_decay": 0.1}
        if self.fused:
            opt = FusedAdamW(
                self.parameters(), **kwargs, max_grad_norm=self.max_grad_norm, state_dtype=self.state_dtype,
                int8_min_numel=0,
            )  # fmt: skip
        else:
            opt = torch.optim.AdamW(self.parameters(), **kwargs)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.our_clip:
            gradacc_ext.utils.clip_grad_norm_(self.parameters(), gradient_clip_val)
        else:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


class AccumulatorRegressor(Regressor):
    """Manual optimisation: the window runs in GradientAccumulator (GradientAccumulatorCallback)."""

    def __init__(self, fused: bool, loss_factor: float = 1.0, state_dtype: str = "fp32") -> None:
        super().__init__(fused, loss_factor=loss_factor, state_dtype=state_dtype)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        with self.accumulator.micro_step():
            loss = super().training_step(batch, batch_idx)
            self.accumulator.backward(loss)
        return loss


def trainer(precision: str | None, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=kwargs.pop("devices", 1),
        max_epochs=kwargs.pop("max_epochs", 1),
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        **kwargs,
    )


def loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(regression_data(BATCHES), batch_size=3, shuffle=False)


def fit(module: pl.LightningModule, precision: str | None, **kwargs) -> dict[str, torch.Tensor]:
    trainer(precision, **kwargs).fit(module, loader())
    return params_of(module)
