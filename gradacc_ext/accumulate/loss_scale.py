"""Dynamic loss scaling through a torch.amp.GradScaler, without its unscale_/step.

The accumulator unscales inside its own final pass and computes found_inf
itself, so it uses the scaler only for scale(loss) (public) and for the
growth/backoff update. GradScaler has no public way to read its scale
without a host sync or to feed update() an externally computed found_inf;
the two functions at the bottom are the only places that touch its
private attributes.
"""

from __future__ import annotations

import torch

from .config import GradientAccumulationConfig


class LossScale:
    """The scale of one window: constant while the window accumulates, updated once at its end."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        if not scaler.is_enabled():
            raise ValueError("GradientAccumulator: the GradScaler passed as scaler= is disabled (enabled=False)")
        self.scaler = scaler

    @classmethod
    def for_config(
        cls, config: GradientAccumulationConfig, scaler: torch.amp.GradScaler | None, device: torch.device
    ) -> LossScale | None:
        """The loss scale of mixed_precision='fp16' (the given scaler, or one made from the config); else None."""
        mode = config.mixed_precision
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"GradientAccumulator: scaler must be a torch.amp.GradScaler, got {type(scaler)}")
        if mode != "fp16":
            if scaler is not None:
                raise ValueError(
                    f"GradientAccumulator: a scaler was given but config.mixed_precision={mode!r}; "
                    "loss scaling is only used with mixed_precision='fp16'"
                )
            return None
        if scaler is None:
            scaler = torch.amp.GradScaler(
                device.type,
                init_scale=config.init_scale,
                growth_factor=config.growth_factor,
                backoff_factor=config.backoff_factor,
                growth_interval=config.growth_interval,
            )
        return cls(scaler)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def tensor(self, device: torch.device) -> torch.Tensor:
        """The current scale as a device tensor (no host sync)."""
        if _scale_tensor(self.scaler) is None:
            self.scaler.scale(torch.zeros((), device=device))  # GradScaler creates its scale lazily in scale()
        return _scale_tensor(self.scaler)

    def update(self, found_inf: torch.Tensor) -> None:
        """Back off on overflow, grow after growth_interval clean windows: on the device, no sync."""
        _update_with_found_inf(self.scaler, found_inf)

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scaler.load_state_dict(state)


def _scale_tensor(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    # GradScaler.get_scale() calls .item() (a host sync); the device tensor is `_scale`.
    return scaler._scale


def _update_with_found_inf(scaler: torch.amp.GradScaler, found_inf: torch.Tensor) -> None:
    # update() reads the found_inf tensors that its unscale_() records per optimizer and
    # device; we record ours in that slot so update() runs its own growth/backoff logic.
    scaler._per_optimizer_states[id(scaler)]["found_inf_per_device"][found_inf.device] = found_inf
    scaler.update()
