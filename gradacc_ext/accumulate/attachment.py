"""The accumulator's two construction phases: the config first, the model and optimizer at attach().

GradientAccumulator(config) holds only its config until attach(model, optimizer) builds what runs the
window (buffers, hooks, stepper, ...). Those attributes are declared on the class as SetByAttach
stand-ins: read before attach(), each raises NotAttachedError, which says what to call; attach() sets
the real ones on the instance, which hide the stand-ins.
"""

from __future__ import annotations

from typing import Any

import torch

from .config import GradientAccumulationConfig


class NotAttachedError(AttributeError):
    """Read before attach(): the accumulator was built as GradientAccumulator(config) and has no model yet.

    An AttributeError, so hasattr() is False for what attach() has not set yet.
    """


class SetByAttach:
    """Class-level stand-in for an attribute that attach() sets on the instance."""

    name = "?"

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            return self
        raise NotAttachedError(
            f"{type(obj).__name__}.{self.name}: the accumulator has no model and optimizer yet; give "
            "them with attach(model, optimizer) or build it as GradientAccumulator(model, optimizer, config)"
        )

    @classmethod
    def many(cls, count: int) -> tuple[SetByAttach, ...]:
        """`count` stand-ins, for one tuple assignment in a class body (each learns its name there)."""
        return tuple(cls() for _ in range(count))


def sort_construction(model_or_params: Any, config: Any) -> tuple[Any, Any]:
    """GradientAccumulator(config) gives the config first: (model_or_params, config) in their places."""
    if isinstance(model_or_params, GradientAccumulationConfig) and config is None:
        return None, model_or_params
    if not isinstance(config, GradientAccumulationConfig):
        raise TypeError(f"GradientAccumulator: config must be a GradientAccumulationConfig, got {type(config)}")
    return model_or_params, config


def check_attach(attached: bool, model_or_params: Any, optimizer: Any, scheduler: Any) -> None:
    """attach() runs once, with the model (or parameters) and an optimizer both given, and a steppable scheduler."""
    if attached:
        raise RuntimeError("GradientAccumulator.attach: the accumulator already has its model and optimizer")
    for name, value in (("model_or_params", model_or_params), ("optimizer", optimizer)):
        if value is None:
            raise TypeError(f"GradientAccumulator: {name} is missing (give the model and the optimizer together)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"GradientAccumulator: optimizer must be a torch.optim.Optimizer, got {type(optimizer)}")
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise TypeError(f"GradientAccumulator: scheduler must have a step() method, got {type(scheduler)}")
