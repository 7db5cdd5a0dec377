"""The guides' entry points that gradacc_ext's own accumulators keep, over the core ones (gradacc_ext.accumulate).

gradacc_ext.GradientAccumulator and AdaptiveGradientAccumulator are the core accumulators plus three
things from the guides: the construction form GradientAccumulator(config), then attach(model,
optimizer); accumulate_gradients(loss, model, optimizer, scaler), which is backward() plus a stats
dict; and get_accumulation_stats(). gradacc_ext.compat's accumulators add the rest of the guides'
call shapes (accumulator.py).
"""

from __future__ import annotations

from typing import Any

import torch

from ..accumulate import accumulator as core
from ..accumulate import adaptive
from ..accumulate.config import GradientAccumulationConfig
from .reports import after_backward, all_stats, check_same_objects


class GuideEntryPoints:
    """Mixed into a core accumulator: the two-phase construction and the guides' two stats entry points."""

    def __init__(
        self,
        model_or_params: torch.nn.Module | Any | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        config: GradientAccumulationConfig | None = None,
        scheduler: Any | None = None,
        scaler: torch.amp.GradScaler | None = None,
        **options: Any,
    ) -> None:
        if isinstance(model_or_params, GradientAccumulationConfig) and config is None:
            model_or_params, config = None, model_or_params  # GradientAccumulator(config)
        if not isinstance(config, GradientAccumulationConfig):
            raise TypeError(f"GradientAccumulator: config must be a GradientAccumulationConfig, got {type(config)}")
        self._check_options(**options)  # the core constructor's keyword-only options: checked now, given at attach()
        self.config = config
        self.attached = False
        self._options = options
        if model_or_params is not None or optimizer is not None:
            self.attach(model_or_params, optimizer, scheduler, scaler)
        elif scheduler is not None or scaler is not None:
            raise TypeError("GradientAccumulator: scheduler and scaler are given with the model and optimizer")

    @staticmethod
    def _check_options() -> None:
        """GradientAccumulator's constructor has no keyword-only options."""

    def __getattr__(self, name: str) -> Any:
        # Only reached for a missing attribute: before attach(), that is one the core constructor sets.
        if not name.startswith("__") and self.__dict__.get("attached") is False:
            raise AttributeError(
                f"GradientAccumulator.{name}: the accumulator has no model and optimizer yet; give them with "
                "attach(model, optimizer) or GradientAccumulator(model, optimizer, config)"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def attach(
        self,
        model_or_params: torch.nn.Module | Any,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        """Gives an accumulator built as GradientAccumulator(config) its model and optimizer (once)."""
        if self.attached:
            raise RuntimeError("GradientAccumulator.attach: the accumulator already has its model and optimizer")
        for name, value in (("model_or_params", model_or_params), ("optimizer", optimizer)):
            if value is None:
                raise TypeError(f"GradientAccumulator: {name} is missing (give the model and the optimizer together)")
        super().__init__(model_or_params, optimizer, self.config, scheduler, scaler, **self._options)
        self.attached = True

    def close(self) -> None:
        if self.attached:  # an accumulator never attached has no hooks
            super().close()

    def accumulate_gradients(
        self,
        loss: torch.Tensor,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: torch.amp.GradScaler | None = None,
        *,
        num_items: int | torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """Compatibility entry point of the guides: backward(loss, num_items) plus a stats dict.

        model/optimizer/scaler may be passed as in the guides' call shape; each
        must be the object this accumulator was built with (any disabled scaler
        is accepted: no loss scaling). gradacc_ext.compat.GradientAccumulator
        also takes the other guides' order and attaches on the first call.
        """
        if isinstance(loss, torch.nn.Module):
            raise TypeError(
                "GradientAccumulator.accumulate_gradients: the first argument is a model; this is the (loss, model, "
                "optimizer, scaler) order. gradacc_ext.compat.GradientAccumulator takes both orders"
            )
        own_scaler = self.window_state().scaler
        if scaler is not None and own_scaler is None and not scaler.is_enabled():
            scaler = None
        check_same_objects(
            model=(model, self.module), optimizer=(optimizer, self.optimizer), scaler=(scaler, own_scaler)
        )
        closed = self.backward(loss, num_items)
        return after_backward(self, closed, loss)

    def get_accumulation_stats(self) -> dict[str, Any]:
        """Every statistic as host values (reads the device-side norm history: one sync)."""
        return all_stats(self)


class GradientAccumulator(GuideEntryPoints, core.GradientAccumulator):
    """GradientAccumulator(model_or_params, optimizer, config, scheduler=None, scaler=None), or
    GradientAccumulator(config) and attach(model, optimizer, ...) later (see the core class)."""


class AdaptiveGradientAccumulator(GuideEntryPoints, adaptive.AdaptiveGradientAccumulator):
    """AdaptiveGradientAccumulator(model_or_params, optimizer, config, ..., micro_batch_size=None,
    min_micro_batch_size=1), or AdaptiveGradientAccumulator(config, ...) and attach() later."""

    _check_options = staticmethod(adaptive.check_split_sizes)  # at construction, attached or not
