"""Choosing micro-batch size and accumulation steps for a target effective batch; LR scaling.

plan_accumulation prefers an exact plan (micro * steps * world_size ==
target): among step counts whose micro-batch stays within
max_micro_batch_size and is at least half of it (so exactness never costs
more than about twice the micro-steps of the fastest plan), the fewest steps
that divide the target exactly. Only when no such plan exists does it take
the fewest steps that fit and round the micro-batch; that plan says in
`note` how far it misses the target and why.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from .accumulate.config import GradientAccumulationConfig

Rounding = Literal["nearest", "down", "up"]


def _positive_int(func: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{func}: {name} must be an integer >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class AccumulationPlan:
    """micro_batch_size per rank and step, accumulation_steps per optimizer step, and what they give."""

    target_batch_size: int
    micro_batch_size: int
    accumulation_steps: int
    world_size: int
    effective_batch_size: int
    note: str

    @property
    def exact(self) -> bool:
        """Whether the plan meets the target exactly."""
        return self.effective_batch_size == self.target_batch_size

    def config(self, **options) -> GradientAccumulationConfig:
        """A GradientAccumulationConfig for this plan (other fields from `options`)."""
        return GradientAccumulationConfig(
            accumulation_steps=self.accumulation_steps,
            micro_batch_size=self.micro_batch_size,
            world_size=self.world_size,
            **options,
        )


def plan_accumulation(
    target_batch_size: int,
    max_micro_batch_size: int,
    world_size: int = 1,
    rounding: Rounding = "nearest",
) -> AccumulationPlan:
    """The plan reaching target_batch_size with micro-batches of at most max_micro_batch_size per rank.

    rounding, when the target is not reachable exactly: "nearest" (ties go
    down), "down" (never above the target) or "up" (never below it).
    """
    func = "plan_accumulation"
    target = _positive_int(func, "target_batch_size", target_batch_size)
    limit = _positive_int(func, "max_micro_batch_size", max_micro_batch_size)
    world = _positive_int(func, "world_size", world_size)
    if rounding not in ("nearest", "down", "up"):
        raise ValueError(f"{func}: rounding must be 'nearest', 'down' or 'up', got {rounding!r}")
    if target < world:
        raise ValueError(
            f"{func}: target_batch_size={target} is smaller than world_size={world}; every rank needs at least one "
            "item per step"
        )
    fewest = math.ceil(target / (limit * world))
    steps = _fewest_exact_steps(target, limit, world, fewest) or fewest
    per_step = steps * world
    # high <= limit by the choice of steps; low is at least 1 (an empty micro-batch is no plan).
    low, high = max(target // per_step, 1), math.ceil(target / per_step)
    if rounding == "down" or (rounding == "nearest" and target - low * per_step <= high * per_step - target):
        micro = low
    else:
        micro = high
    effective = micro * per_step
    if effective == target:
        note = f"exact: {micro} per micro-batch x {steps} steps x {world} ranks = {target}"
    else:
        note = (
            f"inexact: target {target} is not a multiple of steps x ranks = {per_step}, and no step count keeps "
            f"micro-batches between {(limit + 1) // 2} and {limit} exactly; with {steps} steps (the fewest that "
            f"fit), rounding {rounding!r}: "
            f"{micro} per micro-batch gives {effective} ({effective - target:+d}, "
            f"{100 * (effective - target) / target:+.1f}%)"
        )
    return AccumulationPlan(target, micro, steps, world, effective, note)


def _fewest_exact_steps(target: int, limit: int, world: int, fewest: int) -> int | None:
    """The fewest steps >= fewest giving an exact plan with a micro-batch in [ceil(limit / 2), limit], or None."""
    floor = (limit + 1) // 2
    steps = fewest
    while target / (steps * world) >= floor:
        if target % (steps * world) == 0:
            return steps
        steps += 1
    return None


def probe_max_micro_batch_size(
    run: Callable[[int], object],
    upper: int,
    lower: int = 1,
) -> int:
    """The largest micro-batch size in [lower, upper] for which `run(size)` does not raise torch.OutOfMemoryError.

    run(size) should do one forward and backward at that size (on CUDA). Sizes
    are tried doubling from `lower`, then bisected; after each OOM the CUDA
    cache is emptied. Raises RuntimeError if even `lower` runs out of memory.
    Assumes memory use grows with the size.
    """
    func = "probe_max_micro_batch_size"
    upper, lower = _positive_int(func, "upper", upper), _positive_int(func, "lower", lower)
    if lower > upper:
        raise ValueError(f"{func}: lower={lower} must be <= upper={upper}")

    def fits(size: int) -> bool:
        try:
            run(size)
            return True
        except torch.OutOfMemoryError:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return False

    if not fits(lower):
        raise RuntimeError(f"{func}: even micro-batch size {lower} runs out of memory")
    good, bad = lower, None
    while bad is None and good < upper:
        trial = min(2 * good, upper)
        if fits(trial):
            good = trial
        else:
            bad = trial
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def _check_lr(func: str, base_lr: float, base_batch_size: int, batch_size: int) -> None:
    is_number = isinstance(base_lr, (int, float)) and not isinstance(base_lr, bool)
    if not (is_number and math.isfinite(base_lr) and base_lr > 0):
        raise ValueError(f"{func}: base_lr must be a finite number > 0, got {base_lr!r}")
    _positive_int(func, "base_batch_size", base_batch_size)
    _positive_int(func, "batch_size", batch_size)


def scale_lr_linear(base_lr: float, base_batch_size: int, batch_size: int) -> float:
    """Linear scaling rule (Goyal et al. 2017): lr grows in proportion to the effective batch (SGD)."""
    _check_lr("scale_lr_linear", base_lr, base_batch_size, batch_size)
    return base_lr * batch_size / base_batch_size


def scale_lr_sqrt(base_lr: float, base_batch_size: int, batch_size: int) -> float:
    """Square-root scaling rule: lr grows with the square root of the effective batch (Adam-family)."""
    _check_lr("scale_lr_sqrt", base_lr, base_batch_size, batch_size)
    return base_lr * math.sqrt(batch_size / base_batch_size)
