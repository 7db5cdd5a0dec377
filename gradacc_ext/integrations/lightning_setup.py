"""What GradientAccumulatorCallback takes from Lightning's Trainer for the accumulator: the model as the strategy
wraps it, and the precision plugin's GradScaler. A strategy or precision that the accumulator cannot run exactly
is refused here, at fit start, before the accumulator exists.

DDP: under manual optimisation Lightning prepares DDP's reducer only in manual_backward (its forward redirection
turns require_backward_grad_sync off once training_step has returned, so DDP's forward never prepares it), so a
backward run by the accumulator is never reduced by DDP. Given the DistributedDataParallel wrapper, the
accumulator picks its "buffer" DDP sync (distributed/ddp.py): each micro-step under no_sync, the window's sums
all-reduced once at the window end. Given the bare LightningModule it would pick the single-process sync, and
the ranks would drift.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from ..accumulate import GradientAccumulationConfig

# Exact types, not subclasses: DeepSpeedStrategy and XLAStrategy derive from DDPStrategy but shard, replicate or
# reduce gradients in their own ways, which the accumulator's data-parallel syncs do not know.
SUPPORTED_STRATEGIES = (SingleDeviceStrategy, DDPStrategy)
_AUTOCAST = {"16-mixed": "fp16", "bf16-mixed": "bf16"}  # Lightning's MixedPrecision -> config.mixed_precision


def accumulated_model(
    trainer: pl.Trainer, pl_module: pl.LightningModule, config: GradientAccumulationConfig
) -> torch.nn.Module:
    """The module the accumulator is built over: DDP's wrapper under Lightning's DDP strategies, else pl_module."""
    strategy = trainer.strategy
    if type(strategy) not in SUPPORTED_STRATEGIES:
        raise ValueError(
            f"GradientAccumulatorCallback supports Lightning's single-device strategy and DDPStrategy (strategy='ddp', "
            f"'ddp_spawn', 'ddp_fork', 'ddp_notebook'); this Trainer runs {type(strategy).__name__}, whose sharded, "
            "offloaded or model-parallel gradients the accumulator cannot sum exactly: use Lightning's own "
            "accumulate_grad_batches with that strategy"
        )
    if not isinstance(strategy, DDPStrategy):
        return pl_module
    if config.ddp_reduce == "overlap":
        raise ValueError(
            "GradientAccumulatorCallback: GradientAccumulationConfig.ddp_reduce='overlap' needs DDP's reducer in the "
            "closing backward, and Lightning's manual optimisation prepares it only in manual_backward(), not in "
            "the accumulator's backward: use ddp_reduce='buffer' (the default; one all-reduce at each window end)"
        )
    return strategy.model


def lightning_scaler(trainer: pl.Trainer, config: GradientAccumulationConfig) -> torch.amp.GradScaler | None:
    """The GradScaler of Lightning's precision="16-mixed" (the accumulator scales each loss with it, unscales and
    updates it once per window, as Lightning's own accumulate_grad_batches does); None for other precisions.

    Lightning's autocast wraps training_step; a config.mixed_precision of another dtype would autocast again
    inside it and compute in a dtype the Trainer was not asked for, so it is refused.
    """
    plugin = trainer.precision_plugin
    if not isinstance(plugin, MixedPrecision):
        return None
    autocast = _AUTOCAST[plugin.precision]
    if config.mixed_precision not in ("no", autocast):
        raise ValueError(
            f"GradientAccumulatorCallback: Trainer(precision={plugin.precision!r}) autocasts to {autocast}, but "
            f"GradientAccumulationConfig.mixed_precision={config.mixed_precision!r} would autocast to another dtype "
            "inside it: set mixed_precision='no' (Lightning's autocast and, for '16-mixed', its GradScaler are "
            "used), or Trainer(precision='32') with the config's mixed_precision"
        )
    return plugin.scaler
