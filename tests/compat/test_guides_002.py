"""Seeds 002 and 004, and the compat config's aliases and errors: the snippets as written, and clear
errors for what the guides' fields cannot mean here."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from _guides import assert_same_params, hand_loop, make_batches, make_model, run_snippet

from gradacc_ext.cli.main import build_parser
from gradacc_ext.compat import GradientAccumulationConfig

SEED002_TRAINER = """
from gradacc_ext.compat import GradientAccumulationTrainer, create_accumulation_config

# Create configuration
config = create_accumulation_config(
    target_batch_size=128,
    max_batch_size=32,
    use_amp=True
)

# Create trainer
trainer = GradientAccumulationTrainer(
    model=model,
    train_loader=train_loader,
    config=config,
    optimizer=optimizer,
    loss_fn=loss_fn
)

# Training loop
for epoch in range(num_epochs):
    metrics = trainer.train_epoch(epoch)
    print(f"Epoch {epoch}: Loss={metrics['train_loss']:.4f}")
"""


def test_seed002_trainer_epochs_equal_the_hand_written_loop():
    model, twin = make_model(21), make_model(21)
    batches = make_batches(8, 32, 22)
    ns = run_snippet(
        SEED002_TRAINER,
        model=model,
        train_loader=batches,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=F.cross_entropy,
        num_epochs=2,
    )
    assert ns["config"].accumulation_steps == 4 and ns["config"].mixed_precision == "fp16"
    assert ns["metrics"]["optimizer_steps"] == 2 and ns["metrics"]["train_loss"] > 0
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    for _ in range(2):
        hand_loop(twin, opt, batches, 4)
    assert_same_params(model, twin)  # float64 is never autocast, and a power-of-2 loss scale is exact


SEED002_MANAGER = """
from gradacc_ext.compat import GradientAccumulationManager

# Create manager
manager = GradientAccumulationManager(config)

# Custom training loop
for epoch in range(num_epochs):
    for batch_idx, batch in enumerate(train_loader):
        # Forward pass
        outputs = model(batch)
        loss = loss_fn(outputs, targets)

        # Accumulate gradients
        manager.accumulate_gradients(loss, model)

        # Check memory and adjust if needed
        manager.check_memory_and_adjust(model)

        # Update if needed
        if manager.should_update(batch_idx):
            update_info = manager.update_optimizer(optimizer, model)
            scheduler.step()

            # Log status
            status = manager.get_status()
            print(f"Effective batch size: {status['effective_batch_size']}")
"""


def test_seed002_manager_equals_the_hand_written_loop():
    from _guides import TargetsAlongside

    model, twin = make_model(23), make_model(23)
    batches = make_batches(8, 32, 24)
    config = GradientAccumulationConfig(
        accumulation_steps=4, effective_batch_size=128, max_batch_size=32, strategy="standard", auto_adjust=True
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with pytest.warns(UserWarning, match="held until update_optimizer"):
        ns = run_snippet(
            SEED002_MANAGER,
            config=config,
            model=model,
            train_loader=TargetsAlongside(batches, {}),
            loss_fn=F.cross_entropy,
            optimizer=optimizer,
            scheduler=scheduler,
            num_epochs=1,
        )
    assert ns["update_info"]["optimizer_steps"] == 2 and ns["status"]["effective_batch_size"] == 128
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    twin_sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for start in (0, 4):
        hand_loop(twin, opt, batches[start : start + 4], 4)
        twin_sched.step()
    assert_same_params(model, twin)


SEED002_MEMORY_MONITOR = """
from gradacc_ext.compat import MemoryMonitor

monitor = MemoryMonitor()

# Get current memory usage
memory_usage = monitor.get_memory_usage()
print(f"GPU Utilization: {memory_usage['gpu_utilization']:.2f}")
print(f"Memory Allocated: {memory_usage['memory_allocated']:.2f}GB")

# Get memory trend
trend = monitor.get_memory_trend()
print(f"Memory Trend: {trend['trend']}")

# Get recommendations
recommendations = monitor.get_memory_recommendations()
for rec in recommendations:
    print(f"Recommendation: {rec}")
"""


def test_seed002_memory_monitor_reports_without_a_gpu():
    ns = run_snippet(SEED002_MEMORY_MONITOR)
    assert ns["trend"]["trend"] in ("unknown", "stable", "increasing", "decreasing")
    if not torch.cuda.is_available():
        assert ns["memory_usage"]["memory_allocated"] == 0.0 and "no CUDA device" in ns["memory_usage"]["note"]
        assert len(ns["recommendations"]) == 1 and "nothing to recommend" in ns["recommendations"][0]


def test_seed004_demo_flags_parse():
    args = build_parser().parse_args(["demo", "--batch-size", "2", "--grad-accum-steps", "8", "--use-amp", "--compile"])
    assert (args.batch_size, args.grad_accum_steps, args.amp, args.compile) == (2, 8, "fp16", True)


@pytest.mark.parametrize(
    "fields,expected",
    [
        (dict(gradient_clipping=1.0), dict(max_grad_norm=1.0, accumulation_steps=4)),
        (dict(gradient_clip_norm=0.0, gradient_clip_value=0.5), dict(max_grad_norm=None, clip_value=0.5)),
        (dict(use_amp=True, amp_dtype=torch.bfloat16), dict(mixed_precision="bf16")),
        (dict(use_amp=False), dict(mixed_precision="no")),
        (dict(mixed_precision=True), dict(mixed_precision="fp16")),
        (dict(mixed_precision="bfloat16"), dict(mixed_precision="bf16")),
        (dict(accumulation_steps=8, effective_batch_size=32, target_batch_size=256), dict(micro_batch_size=32)),
        (dict(accumulation_steps=4, effective_batch_size=128, max_batch_size=32), dict(target_batch_size=128)),
        (dict(effective_batch_size=64, max_batch_size=16), dict(accumulation_steps=4)),
        (dict(strategy="dynamic"), dict(strategy="dynamic")),
        (dict(adaptive_accumulation=True), dict(strategy="adaptive")),
    ],
)
def test_aliases(fields, expected):
    config = GradientAccumulationConfig(**fields)
    assert {k: getattr(config, k) for k in expected} == expected


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(gradient_clipping=1.0, max_grad_norm=2.0), "both set max_grad_norm"),
        (dict(gradient_clip_norm=1.0, gradient_clipping=0.5), "both set max_grad_norm"),
        (dict(use_amp=True, mixed_precision="no"), "disagree"),
        (dict(effective_batch_size=32, target_batch_size=64, max_batch_size=8), "ambiguous"),
        (dict(strategy="standard", adaptive_accumulation=True), "disagree"),
        (dict(strategy="fast"), "strategy must be one of"),
        (dict(warmup_steps=100), "scheduler="),
        (dict(gradient_checkpointing=True), "torch.utils.checkpoint"),
        (dict(sync_gradients=False), "can only be True"),
        (dict(amp_dtype=torch.float16), "only read with use_amp=True"),
        (dict(accumulation_steps=3, effective_batch_size=32, target_batch_size=128), "gives an effective batch"),
        (dict(learning_rate=0.1), "unknown field 'learning_rate'"),
    ],
)
def test_conflicts_and_unsupported_fields_are_clear_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        GradientAccumulationConfig(**fields)


def test_no_effect_fields_are_logged_once_with_the_reason(caplog):
    with caplog.at_level(logging.INFO, logger="gradacc_ext.compat"):
        config = GradientAccumulationConfig(log_accumulation=True, memory_threshold=0.8, gradient_scaling=True)
    assert set(config.guide_notes) == {"log_accumulation", "memory_threshold", "gradient_scaling"}
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "memory_threshold" in messages[0] and "scale_lr_linear" in messages[0]


def test_keyword_forms_and_seed003_step_count():
    """Keyword construction and calls; seed 003's promise: ceil(batches / steps) optimizer steps, one
    grad norm each (the short last window is applied by flush(), or by the guides' accumulation_context)."""
    from gradacc_ext.compat import GradientAccumulator

    model = make_model(25)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = GradientAccumulator(config=GradientAccumulationConfig(accumulation_steps=4))
    with acc.accumulation_context(model=model):
        for x, y in make_batches(10, 3, 26):
            acc.accumulate_gradients(loss=F.cross_entropy(model(x), y), model=model, optimizer=optimizer)
    assert acc.optimizer_steps == 3 and len(acc.grad_norm_history()) == 3  # ceil(10 / 4)


def test_manager_given_its_optimizer_holds_nothing():
    import warnings

    from gradacc_ext.compat import GradientAccumulationManager

    model = make_model(27)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = GradientAccumulationManager(GradientAccumulationConfig(accumulation_steps=2), optimizer=optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i, (x, y) in enumerate(make_batches(4, 3, 28)):
            manager.accumulate_gradients(F.cross_entropy(model(x), y), model)
            assert manager.get_status()["held_losses"] == 0
            if manager.should_update(i):
                manager.update_optimizer(optimizer, model)
    assert manager.get_status()["optimizer_steps"] == 2
