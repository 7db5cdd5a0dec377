"""Planner and LR scaling: table-driven, including non-divisible targets and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from gradacc_ext.accumulate.config import GradientAccumulationConfig
from gradacc_ext.planning import (
    AccumulationPlan,
    plan_accumulation,
    probe_max_micro_batch_size,
    scale_lr_linear,
    scale_lr_sqrt,
)

# (target, max_micro, world, rounding) -> (micro, steps, effective)
PLANS = [
    ((64, 16, 1, "nearest"), (16, 4, 64)),
    ((64, 64, 1, "nearest"), (64, 1, 64)),
    ((64, 100, 1, "nearest"), (64, 1, 64)),
    ((64, 8, 4, "nearest"), (8, 2, 64)),
    ((100, 32, 1, "nearest"), (25, 4, 100)),  # exact with a micro-batch below the limit
    ((97, 32, 1, "nearest"), (24, 4, 96)),  # prime: 96 is closer than 100
    ((97, 32, 1, "up"), (25, 4, 100)),
    ((97, 32, 1, "down"), (24, 4, 96)),
    ((99, 32, 1, "nearest"), (25, 4, 100)),
    ((10, 3, 2, "nearest"), (2, 2, 8)),  # 10 / (2 steps x 2 ranks) = 2.5: tie goes down
    ((10, 3, 2, "up"), (3, 2, 12)),
    ((5, 1, 4, "down"), (1, 2, 8)),  # rounding down would leave an empty micro-batch
    ((1, 1, 1, "nearest"), (1, 1, 1)),
    ((512, 12, 4, "nearest"), (8, 16, 512)),  # exact beats the fewest steps (11 x 12 x 4 = 528)
    ((256, 12, 4, "nearest"), (8, 8, 256)),  # not 6 x 11 x 4 = 264
    ((96, 10, 1, "nearest"), (8, 12, 96)),  # the fewest steps (10) give 100; 12 x 8 is exact
    ((97, 8, 1, "nearest"), (7, 13, 91)),  # prime: the only exact plan (97 x 1) is below half the limit
]


@pytest.mark.parametrize("args,expected", PLANS, ids=[str(a) for a, _ in PLANS])
def test_plan_table(args, expected):
    target, limit, world, rounding = args
    plan = plan_accumulation(target, limit, world, rounding)
    assert (plan.micro_batch_size, plan.accumulation_steps, plan.effective_batch_size) == expected
    assert plan.micro_batch_size <= limit
    assert plan.effective_batch_size == plan.micro_batch_size * plan.accumulation_steps * world
    fewest = math.ceil(target / (limit * world))
    exact_steps = [
        s
        for s in range(fewest, target + 1)
        if target % (s * world) == 0 and (limit + 1) // 2 <= target // (s * world) <= limit
    ]
    # The fewest steps giving an exact plan with a micro-batch of at least half the limit, else the fewest that fit.
    assert plan.accumulation_steps == (exact_steps[0] if exact_steps else fewest)
    assert plan.exact == (plan.effective_batch_size == target)
    if plan.exact:
        assert plan.note.startswith("exact")
    else:
        assert plan.note.startswith("inexact") and f"{plan.effective_batch_size - target:+d}" in plan.note
    if rounding == "up":
        assert plan.effective_batch_size >= target


def test_plan_is_frozen_and_makes_a_config():
    plan = plan_accumulation(96, 16, 2)
    with pytest.raises(AttributeError):
        plan.micro_batch_size = 3
    config = plan.config(max_grad_norm=1.0)
    assert isinstance(plan, AccumulationPlan) and isinstance(config, GradientAccumulationConfig)
    assert config.accumulation_steps == 3 and config.effective_batch_size == 96 and config.max_grad_norm == 1.0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(target_batch_size=0, max_micro_batch_size=4), "target_batch_size must be an integer >= 1"),
        (dict(target_batch_size=8.0, max_micro_batch_size=4), "target_batch_size must be an integer >= 1"),
        (dict(target_batch_size=8, max_micro_batch_size=-1), "max_micro_batch_size must be an integer >= 1"),
        (dict(target_batch_size=8, max_micro_batch_size=4, world_size=0), "world_size must be an integer >= 1"),
        (dict(target_batch_size=3, max_micro_batch_size=4, world_size=4), "smaller than world_size"),
        (dict(target_batch_size=8, max_micro_batch_size=4, rounding="floor"), "rounding must be"),
    ],
)
def test_plan_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_accumulation(**kwargs)


@pytest.mark.parametrize("limit,upper,lower", [(37, 128, 1), (1, 64, 1), (64, 64, 1), (5, 9, 3)])
def test_probe_finds_largest_fitting_size(limit, upper, lower):
    tried = []

    def run(size):
        tried.append(size)
        if size > limit:
            raise torch.OutOfMemoryError(f"injected OOM at {size}")

    assert probe_max_micro_batch_size(run, upper, lower) == min(limit, upper)
    assert len(tried) <= 2 * math.ceil(math.log2(upper)) + 2


def test_probe_floor_and_bad_input():
    def always_oom(size):
        raise torch.OutOfMemoryError("injected")

    with pytest.raises(RuntimeError, match="even micro-batch size 2 runs out of memory"):
        probe_max_micro_batch_size(always_oom, 8, 2)
    with pytest.raises(ValueError, match="lower=9 must be <= upper=8"):
        probe_max_micro_batch_size(always_oom, 8, 9)


@pytest.mark.parametrize(
    "base,base_batch,batch,linear,sqrt",
    [(0.1, 256, 1024, 0.4, 0.2), (1e-3, 64, 16, 2.5e-4, 5e-4), (3e-4, 32, 32, 3e-4, 3e-4)],
)
def test_lr_scaling(base, base_batch, batch, linear, sqrt):
    assert scale_lr_linear(base, base_batch, batch) == pytest.approx(linear, rel=1e-12)
    assert scale_lr_sqrt(base, base_batch, batch) == pytest.approx(sqrt, rel=1e-12)


@pytest.mark.parametrize("args", [(0.0, 32, 64), (math.nan, 32, 64), (0.1, 0, 64), (0.1, 32, 2.5), (True, 32, 64)])
def test_lr_scaling_bad_input(args):
    for func in (scale_lr_linear, scale_lr_sqrt):
        with pytest.raises(ValueError, match=func.__name__):
            func(*args)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(), "needs accumulation_steps"),
        (dict(accumulation_steps=0), "accumulation_steps must be an integer >= 1"),
        (dict(accumulation_steps=True), "accumulation_steps must be an integer >= 1"),
        (dict(target_batch_size=100, micro_batch_size=32), "nearest achievable effective batches are 96"),
        (dict(accumulation_steps=2, target_batch_size=64, micro_batch_size=16), "gives an effective batch of 32"),
        (dict(accumulation_steps=2, max_grad_norm=-0.5), "max_grad_norm must be a finite number > 0"),
        (dict(accumulation_steps=2, norm_type=1.0), "norm_type must be 2.0 or math.inf"),
        (dict(accumulation_steps=2, clip_value=-1.0), "clip_value must be"),
        (dict(accumulation_steps=2, mixed_precision=True), "mixed_precision must be one of"),
        (dict(accumulation_steps=2, accum_dtype=torch.float16), "accum_dtype must be torch.float32 or None"),
        (dict(accumulation_steps=2, loss_normalization="token"), "loss_normalization must be one of"),
        (dict(accumulation_steps=2, mixed_precision="fp16", skip_nonfinite=False), "skip_nonfinite must be True"),
        (dict(accumulation_steps=2, backoff_factor=1.5), "backoff_factor must be in"),
        (dict(accumulation_steps=2, grad_norm_history=-1), "grad_norm_history must be an integer >= 0"),
        (dict(accumulation_steps=2, backend="cuda"), "backend must be one of"),
        (dict(accumulation_steps=2, world_size=0), "world_size must be an integer >= 1"),
    ],
)
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradientAccumulationConfig(**kwargs)


def test_config_derives_steps():
    config = GradientAccumulationConfig(target_batch_size=128, micro_batch_size=8, world_size=4)
    assert config.accumulation_steps == 4 and config.effective_batch_size == 128
    assert config.to_dict()["accum_dtype"] == "float32"
