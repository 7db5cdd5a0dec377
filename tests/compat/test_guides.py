"""Seeds 000 and 001: each guide's central snippet, as written, does what the guide promises.

Only the import lines are changed (to gradacc_ext.compat) and a small float64 model substituted;
every run is compared with the hand-written loop the guide describes, on the same data.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _guides import TargetsAlongside, assert_same_params, hand_loop, make_batches, make_model, run_snippet


def guide_setup(seed: int, n_batches: int, size: int, gain: float = 1.0):
    model, twin = make_model(seed, gain), make_model(seed, gain)
    batches = make_batches(n_batches, size, seed + 1)
    names = dict(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        criterion=torch.nn.CrossEntropyLoss(),
        scaler=torch.amp.GradScaler("cpu", enabled=False),  # what torch.cuda.amp.GradScaler() is without CUDA
    )
    return names, batches, twin


SEED000_BASIC = """
from gradacc_ext.compat import (
    GradientAccumulationConfig,
    GradientAccumulator
)

# Create configuration
config = GradientAccumulationConfig(
    accumulation_steps=4,
    target_batch_size=32
)

# Create accumulator
accumulator = GradientAccumulator(config)

# Training loop
for batch_idx, batch in enumerate(dataloader):
    # Forward pass
    outputs = model(batch)
    loss = criterion(outputs, targets)

    # Accumulate gradients
    acc_stats = accumulator.accumulate_gradients(
        loss, model, optimizer, scaler
    )

    # Log progress
    if acc_stats["should_update"]:
        print(f"Optimizer updated at step {batch_idx}")
        updated_at.append(batch_idx)
"""


def test_seed000_basic_equals_the_hand_written_loop(caplog):
    names, batches, twin = guide_setup(1, 8, 8)
    with caplog.at_level(logging.INFO, logger="gradacc_ext"):
        ns = run_snippet(SEED000_BASIC, dataloader=TargetsAlongside(batches, {}), updated_at=[], **names)
    assert ns["updated_at"] == [3, 7]
    assert ns["accumulator"].optimizer_steps == 2
    assert any("disabled" in r.getMessage() and "no loss scaling" in r.getMessage() for r in caplog.records)
    hand_loop(twin, torch.optim.Adam(twin.parameters(), lr=0.01), batches, 4)
    assert_same_params(ns["model"], twin)


SEED000_ADAPTIVE_AND_MONITORING = """
from gradacc_ext.compat import AdaptiveGradientAccumulator

# Create adaptive accumulator
config = GradientAccumulationConfig(
    target_batch_size=64,
    auto_adjust_batch_size=True
)

accumulator = AdaptiveGradientAccumulator(config)

# Update configuration based on GPU state
report = accumulator.update_config(model, [0, 1, 2, 3])

# Training with automatic optimization
for batch_idx, batch in enumerate(dataloader):
    outputs = model(batch)
    loss = criterion(outputs, targets)

    acc_stats = accumulator.accumulate_gradients(
        loss, model, optimizer, scaler
    )

    # Log accumulation progress
    if batch_idx % 10 == 0:
        print(f"Batch {batch_idx}: "
              f"Accumulation {acc_stats['accumulation_step']}/{config.accumulation_steps}, "
              f"Loss: {loss.item():.4f}, "
              f"Memory: {acc_stats['memory_used']:.2f}GB")

# Get accumulation statistics
stats = accumulator.get_accumulation_stats()
print(f"Average gradient norm: {stats['avg_gradient_norm']:.4f}")
print(f"Average memory usage: {stats['avg_memory_usage_gb']:.2f}GB")
print(f"Average accumulation time: {stats['avg_accumulation_time']:.4f}s")
"""


def test_seed000_adaptive_update_config_reports_missing_gpus_and_monitoring_keys():
    from gradacc_ext.compat import GradientAccumulationConfig

    names, batches, twin = guide_setup(2, 12, 4)
    ns = run_snippet(
        SEED000_ADAPTIVE_AND_MONITORING,
        GradientAccumulationConfig=GradientAccumulationConfig,
        dataloader=TargetsAlongside(batches, {}),
        **names,
    )
    report = ns["report"]
    if not torch.cuda.is_available():
        assert report["missing"] == [0, 1, 2, 3] and "not present" in report["note"]
    assert ns["config"].accumulation_steps == 4  # the guides' default window
    assert ns["stats"]["optimizer_steps"] == 3 and ns["stats"]["avg_gradient_norm"] > 0
    hand_loop(twin, torch.optim.Adam(twin.parameters(), lr=0.01), batches, 4)
    assert_same_params(ns["model"], twin)


SEED000_MIXED_PRECISION = """
# Use mixed precision for faster training and less memory
from torch.cuda.amp import GradScaler

scaler = GradScaler()

config = GradientAccumulationConfig(
    accumulation_steps=4,
    mixed_precision=True
)
accumulator = GradientAccumulator(config)

for batch in dataloader:
    # In training loop
    with torch.cuda.amp.autocast():
        outputs = model(batch)
        loss = criterion(outputs, targets)

    acc_stats = accumulator.accumulate_gradients(
        loss, model, optimizer, scaler
    )
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the GPU-less behaviour")
@pytest.mark.filterwarnings("ignore:.*CUDA is not available", "ignore:.*torch.cuda.amp.*is deprecated")
def test_seed000_mixed_precision_without_a_gpu_warns_that_no_autocast_ran():
    from gradacc_ext.compat import GradientAccumulationConfig, GradientAccumulator

    names, batches, twin = guide_setup(3, 4, 8)
    names.pop("scaler")
    with pytest.warns(UserWarning, match="without autocast"), pytest.warns(FutureWarning):
        ns = run_snippet(
            SEED000_MIXED_PRECISION,
            GradientAccumulationConfig=GradientAccumulationConfig,
            GradientAccumulator=GradientAccumulator,
            dataloader=TargetsAlongside(batches, {}),
            **names,
        )
    assert ns["config"].mixed_precision == "fp16" and ns["accumulator"].loss_scale() is None
    hand_loop(twin, torch.optim.Adam(twin.parameters(), lr=0.01), batches, 4)
    assert_same_params(ns["model"], twin)


SEED001_BASIC_CLIPPING_CONTEXT = """
from gradacc_ext.compat import (
    GradientAccumulator, GradientAccumulationConfig, AdaptiveGradientAccumulator
)

# Configuration with gradient clipping
config = GradientAccumulationConfig(
    accumulation_steps=4,
    effective_batch_size=32,
    target_batch_size=128,
    gradient_clipping=1.0,  # Clip gradients to norm 1.0
    memory_efficient=True
)

accumulator = GradientAccumulator(config)

# Use accumulation context for memory safety
with accumulator.accumulation_context(model):
    for batch_idx, (data, targets) in enumerate(dataloader):
        outputs = model(data)
        loss = criterion(outputs, targets)

        result = accumulator.accumulate_gradients(
            model, loss, data.size(0), optimizer
        )

        # Gradients are automatically clipped during accumulation
        if result['should_step']:
            print(f"Gradient clipping applied")
            print(f"Effective batch size: {result['effective_batch_size']}")

# Get comprehensive debug information
stats = accumulator.get_accumulation_stats()

print(f"Current step: {stats['current_step']}")
print(f"Accumulation step: {stats['accumulation_step']}")
print(f"Total gradients: {stats['total_gradients']}")
print(f"Effective batch size: {stats['effective_batch_size']}")
print(f"Target batch size: {stats['target_batch_size']}")
print(f"Memory usage entries: {len(stats['memory_usage'])}")
print(f"Performance metrics: {len(stats['performance_metrics'])}")

# Check configuration
config = stats['config']
print(f"Accumulation steps: {config['accumulation_steps']}")
print(f"Memory efficient: {config['memory_efficient']}")
print(f"Adaptive accumulation: {config['adaptive_accumulation']}")
"""


def test_seed001_order_clipping_context_and_debug_keys():
    names, batches, twin = guide_setup(4, 8, 32, gain=20.0)  # the gradient norm exceeds 1.0
    ns = run_snippet(SEED001_BASIC_CLIPPING_CONTEXT, dataloader=batches, **names)
    stats = ns["stats"]
    assert stats["current_step"] == 2 and stats["total_gradients"] == 8 and stats["accumulation_step"] == 0
    assert (stats["effective_batch_size"], stats["target_batch_size"]) == (128, 128)
    assert ns["config"]["memory_efficient"] is True and ns["config"]["adaptive_accumulation"] is False
    assert min(stats["grad_norm_history"]) > 1.0  # so clipping engaged
    norms = hand_loop(twin, torch.optim.Adam(twin.parameters(), lr=0.01), batches, 4, clip=1.0)
    assert stats["grad_norm_history"] == pytest.approx(norms, rel=1e-6)
    assert_same_params(ns["model"], twin)


SEED001_AUTOMATIC_SCALING = """
config = GradientAccumulationConfig(
    effective_batch_size=32,
    target_batch_size=512,  # Large target batch size
    automatic_scaling=True,  # Automatically calculate accumulation steps
    memory_efficient=True
)

# accumulation_steps will be automatically set to 16 (512 // 32)
accumulator = GradientAccumulator(config)
print(f"Automatic accumulation steps: {accumulator.config.accumulation_steps}")
"""


def test_seed001_automatic_scaling_gives_16_steps():
    from gradacc_ext.compat import GradientAccumulationConfig, GradientAccumulator

    ns = run_snippet(
        SEED001_AUTOMATIC_SCALING,
        GradientAccumulationConfig=GradientAccumulationConfig,
        GradientAccumulator=GradientAccumulator,
    )
    assert ns["accumulator"].config.accumulation_steps == 16 and ns["config"].micro_batch_size == 32


SEED001_ERROR_RECOVERY = """
# Training with error handling
try:
    with accumulator.accumulation_context(model):
        for batch_idx, (data, targets) in enumerate(dataloader):
            outputs = model(data)
            loss = criterion(outputs, targets)

            result = accumulator.accumulate_gradients(
                model, loss, data.size(0), optimizer
            )

except Exception as e:
    logger.error(f"Error during accumulation: {e}")
    # Reset accumulation state
    accumulator.reset_stats()
    logger.info("Accumulation state reset")
"""


def test_seed001_error_in_the_context_drops_the_open_window():
    from gradacc_ext.compat import GradientAccumulationConfig, GradientAccumulator

    names, batches, _ = guide_setup(5, 6, 4)
    before = [p.detach().clone() for p in names["model"].parameters()]
    config = GradientAccumulationConfig(accumulation_steps=4, effective_batch_size=4, target_batch_size=16)
    bad = batches[:3] + [(batches[3][0][:, :2], batches[3][1])]  # the 4th batch has the wrong width
    ns = run_snippet(SEED001_ERROR_RECOVERY, accumulator=GradientAccumulator(config), dataloader=bad, **names)
    acc = ns["accumulator"]
    assert acc.optimizer_steps == 0 and acc.micro_steps_in_window == 0
    assert all(p.grad is None for p in names["model"].parameters())
    assert all(torch.equal(p, q) for p, q in zip(names["model"].parameters(), before, strict=True))


SEED001_ADAPTIVE_AND_MIXED_PRECISION = """
# Create adaptive configuration
config = GradientAccumulationConfig(
    accumulation_steps=4,
    effective_batch_size=32,
    target_batch_size=128,
    adaptive_accumulation=True,
    memory_efficient=True,
    track_memory=True
)

accumulator = AdaptiveGradientAccumulator(config)
scaler = torch.cuda.amp.GradScaler()

# Training loop with mixed precision accumulation
for batch_idx, (data, targets) in enumerate(dataloader):
    # Forward pass with mixed precision
    with torch.cuda.amp.autocast():
        outputs = model(data)
        loss = criterion(outputs, targets)

    # Accumulate gradients with scaler
    result = accumulator.accumulate_gradients(
        model, loss, data.size(0), optimizer, scaler
    )

    # Get adaptation stats
    if result['should_step']:
        adaptation_stats = accumulator.get_adaptation_stats()
        print(f"Adaptation stats: {adaptation_stats}")
        print(f"Scaled loss: {result['scaled_loss']:.4f}")
        print(f"Original loss: {result['original_loss']:.4f}")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks that a CUDA scaler without CUDA does not scale")
@pytest.mark.filterwarnings("ignore:.*CUDA is not available", "ignore:.*torch.cuda.amp.*is deprecated")
def test_seed001_adaptive_with_a_cuda_scaler_off_cuda_and_the_loss_keys():
    from gradacc_ext.compat import AdaptiveGradientAccumulator, GradientAccumulationConfig

    names, batches, twin = guide_setup(6, 8, 32)
    names.pop("scaler")
    ns = run_snippet(
        SEED001_ADAPTIVE_AND_MIXED_PRECISION,
        GradientAccumulationConfig=GradientAccumulationConfig,
        AdaptiveGradientAccumulator=AdaptiveGradientAccumulator,
        dataloader=batches,
        **names,
    )
    assert ns["config"].strategy == "adaptive" and ns["adaptation_stats"]["oom_splits"] == 0
    assert float(ns["result"]["scaled_loss"]) == float(ns["result"]["original_loss"])  # no loss scaling
    hand_loop(twin, torch.optim.Adam(twin.parameters(), lr=0.01), batches, 4)
    assert_same_params(ns["model"], twin)
