"""Dynamic loss scaling through a torch.amp.GradScaler, without its unscale_/step.

The accumulator unscales inside its own final pass and computes found_inf
itself, so it uses the scaler only for scale(loss) (public) and for the
growth/backoff update. GradScaler has no public way to read its scale
without a host sync or to feed update() an externally computed found_inf;
the two functions at the bottom are the only places that touch its
private attributes.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from .config import GradientAccumulationConfig

log = logging.getLogger("gradacc_ext")
# config field -> the GradScaler's value of it
_SCALER_SETTINGS = {
    "init_scale": lambda s: s._init_scale,  # no public getter that does not sync
    "growth_factor": lambda s: s.get_growth_factor(),
    "backoff_factor": lambda s: s.get_backoff_factor(),
    "growth_interval": lambda s: s.get_growth_interval(),
}


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
        """The loss scale: an enabled scaler given, in any mode; for mixed_precision='fp16' without one, a scaler
        made from the config; else None.

        A disabled scaler (GradScaler(enabled=False), or any GradScaler on a
        machine without its device, as nanoGPT builds one) means "no loss
        scaling", in every mode; one log line says so.
        """
        mode = config.mixed_precision
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"GradientAccumulator: scaler must be a torch.amp.GradScaler, got {type(scaler)}")
        if scaler is not None and not scaler.is_enabled():
            log.info("GradientAccumulator: the GradScaler passed is disabled (enabled=False): no loss scaling")
            return None
        if mode != "fp16":
            if scaler is None:
                return None
            _scales_beside_users_autocast(config)
        if scaler is None:
            scaler = torch.amp.GradScaler(
                device.type,
                init_scale=config.init_scale,
                growth_factor=config.growth_factor,
                backoff_factor=config.backoff_factor,
                growth_interval=config.growth_interval,
            )
        _check_settings(config, scaler)
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


def _scales_beside_users_autocast(config: GradientAccumulationConfig) -> None:
    """An enabled scaler with mixed_precision 'no' or 'bf16': torch's autocast and loss scaling are
    independent, so the scaler means "scale the loss with it" (the guides autocast in their own code, then
    pass their scaler). Said once, at construction; the overflow-skip it needs must be on."""
    if not config.skip_nonfinite:
        raise ValueError(
            "GradientAccumulator: a GradScaler was given with config.skip_nonfinite=False; loss scaling skips "
            "every step whose gradient overflowed: set skip_nonfinite=True (the default)"
        )
    autocast = "yours (config.mixed_precision='no')" if config.mixed_precision == "no" else "bf16, the config's"
    log.info(
        "GradientAccumulator: loss scaling with the GradScaler passed (scale(loss), unscale, overflow skip and "
        "growth/backoff per window) while autocast is %s",
        autocast,
    )


def _check_settings(config: GradientAccumulationConfig, scaler: torch.amp.GradScaler) -> None:
    """A config field set away from its default must agree with the scaler given, or it would be ignored."""
    defaults = {f.name: f.default for f in dataclasses.fields(GradientAccumulationConfig)}
    for name, read in _SCALER_SETTINGS.items():
        mine, theirs = getattr(config, name), read(scaler)
        if mine != defaults[name] and mine != theirs:
            raise ValueError(
                f"GradientAccumulator: the GradScaler passed has {name}={theirs!r} but config.{name}={mine!r}; "
                f"drop config.{name} (the scaler's settings are used) or make them agree"
            )


def _scale_tensor(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    # GradScaler.get_scale() calls .item() (a host sync); the device tensor is `_scale`.
    return scaler._scale


def _update_with_found_inf(scaler: torch.amp.GradScaler, found_inf: torch.Tensor) -> None:
    # update() reads the found_inf tensors that its unscale_() records per optimizer and
    # device; we record ours in that slot so update() runs its own growth/backoff logic.
    scaler._per_optimizer_states[id(scaler)]["found_inf_per_device"][found_inf.device] = found_inf
    scaler.update()
