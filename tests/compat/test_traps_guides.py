"""Issue 23's guide traps: an enabled GradScaler with the user's own autocast, and the stats' config echo.

The guides autocast in their own code and pass their own scaler whatever mixed_precision says
(seed 000's basic example, seed 001's mixed-precision snippet). On CPU a CUDA scaler disables
itself, which hid the refusal; these tests use an enabled torch.amp.GradScaler("cpu").
"""

from __future__ import annotations

import logging

import pytest
import torch
from _guides import TargetsAlongside, assert_same_params, hand_loop, make_batches, make_model, run_snippet
from test_guides import SEED000_BASIC

from gradacc_ext import GradientAccumulationConfig as CoreConfig
from gradacc_ext import GradientAccumulator as CoreAccumulator
from gradacc_ext.compat import AdaptiveGradientAccumulator, GradientAccumulationConfig, GradientAccumulator

INIT_SCALE = 2.0**16  # a power of two: the float64 window is the same with or without scaling


def scaling_logged(caplog) -> bool:
    return any("loss scaling with the GradScaler passed" in r.getMessage() for r in caplog.records)


def test_seed000_basic_with_an_enabled_scaler_scales_and_equals_the_plain_loop(caplog):
    model, twin = make_model(11), make_model(11)
    batches = make_batches(8, 8, 12)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    names = dict(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        criterion=torch.nn.CrossEntropyLoss(),
        scaler=scaler,
    )
    with caplog.at_level(logging.INFO, logger="gradacc_ext"):
        ns = run_snippet(SEED000_BASIC, dataloader=TargetsAlongside(batches, {}), updated_at=[], **names)
    acc = ns["accumulator"]
    assert ns["updated_at"] == [3, 7] and acc.optimizer_steps == 2
    assert acc.config.mixed_precision == "no" and acc.loss_scale() == INIT_SCALE  # the user's scaler, in use
    said = [r.getMessage() for r in caplog.records if "loss scaling with the GradScaler passed" in r.getMessage()]
    assert len(said) == 1 and "autocast is yours" in said[0]  # said once
    hand_loop(twin, torch.optim.Adam(twin.parameters(), lr=0.01), batches, 4)
    assert_same_params(model, twin)


# Seed 001's mixed-precision snippet as a CPU user writes it: their autocast, their enabled scaler.
SEED001_MIXED_PRECISION_CPU = """
config = GradientAccumulationConfig(
    accumulation_steps=4,
    effective_batch_size=32,
    target_batch_size=128,
    gradient_scaling=True,
    memory_efficient=True,
    track_memory=True
)

accumulator = GradientAccumulator(config)
scaler = torch.amp.GradScaler("cpu")

for batch_idx, (data, targets) in enumerate(dataloader):
    with torch.autocast("cpu", enabled=False):
        outputs = model(data)
        loss = criterion(outputs, targets)

    result = accumulator.accumulate_gradients(model, loss, data.size(0), optimizer, scaler)

    if result['should_step']:
        print(f"Scaled loss: {result['scaled_loss']:.4f}")
        print(f"Original loss: {result['original_loss']:.4f}")
"""


@pytest.mark.parametrize("cls", [GradientAccumulator, AdaptiveGradientAccumulator])
def test_seed001_mixed_precision_snippet_with_an_enabled_cpu_scaler(cls, caplog):
    model, twin = make_model(13), make_model(13)
    batches = make_batches(8, 32, 14)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    names = dict(model=model, optimizer=optimizer, criterion=torch.nn.CrossEntropyLoss())
    with caplog.at_level(logging.INFO, logger="gradacc_ext"):
        ns = run_snippet(
            SEED001_MIXED_PRECISION_CPU,
            GradientAccumulationConfig=GradientAccumulationConfig,
            GradientAccumulator=cls,
            dataloader=batches,
            **names,
        )
    result = ns["result"]
    assert float(result["scaled_loss"]) == pytest.approx(float(result["original_loss"]) * INIT_SCALE, rel=1e-12)
    assert ns["accumulator"].optimizer_steps == 2 and scaling_logged(caplog)
    hand_loop(twin, torch.optim.Adam(twin.parameters(), lr=0.01), batches, 4)
    assert_same_params(model, twin)


def test_core_accumulator_takes_an_enabled_scaler_in_bf16_and_no_modes():
    for mode in ("no", "bf16"):
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        acc = CoreAccumulator(model, opt, CoreConfig(accumulation_steps=2, mixed_precision=mode),
                              scaler=torch.amp.GradScaler("cpu", init_scale=8.0))  # fmt: skip
        assert acc.loss_scale() == 8.0
        with acc.micro_step():
            acc.backward(model(torch.full((1, 3), float("inf"))).sum())
        with acc.micro_step():
            acc.backward(model(torch.randn(1, 3)).sum())
        assert acc.optimizer_steps == 0 and acc.stats.skipped_steps == 1  # the overflow skipped, as GradScaler does
        assert acc.loss_scale() == 4.0  # and backed off


def test_an_enabled_scaler_needs_the_overflow_skip():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="GradScaler was given with config.skip_nonfinite=False"):
        config = CoreConfig(accumulation_steps=2, skip_nonfinite=False)
        CoreAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), config, scaler=torch.amp.GradScaler("cpu"))


# Seed 001's "Monitoring and Logging" config (no memory_efficient given), then its debug read of the config.
def test_stats_config_echoes_the_guide_fields_under_their_own_names():
    config = GradientAccumulationConfig(
        accumulation_steps=8,
        effective_batch_size=32,
        target_batch_size=256,
        track_memory=True,
        log_accumulation=True,
        profile_accumulation=True,
        gradient_clipping=1.0,
        max_memory_usage=0.8,
    )
    model = make_model(15)
    acc = GradientAccumulator(config)
    x, y = make_batches(1, 32, 16)[0]
    loss = torch.nn.functional.cross_entropy(model(x), y)
    acc.accumulate_gradients(model, loss, 32, torch.optim.SGD(model.parameters(), lr=0.1))
    echoed = acc.get_accumulation_stats()["config"]
    assert echoed["memory_efficient"] is True and echoed["adaptive_accumulation"] is False  # seed 001 reads these
    given = {"accumulation_steps": 8, "effective_batch_size": 32, "target_batch_size": 256, "track_memory": True,
             "log_accumulation": True, "profile_accumulation": True, "gradient_clipping": 1.0,
             "max_memory_usage": 0.8}  # fmt: skip
    assert {k: echoed[k] for k in given} == given  # every field passed, as passed (effective_batch_size: seed 001's)
    assert echoed["max_grad_norm"] == 1.0 and echoed["micro_batch_size"] == 32  # and the core fields
    acc.flush()
    acc.update_config(gradient_clipping=2.0)
    assert acc.get_accumulation_stats()["config"]["gradient_clipping"] == 2.0
