"""PyTorch Lightning's own loop with our optimizer and clipping: Trainer(accumulate_grad_batches=4,
gradient_clip_val=1.0), the optimizer and a per-step scheduler from configure_optimizers, precision
"32" and "bf16-mixed". Lightning hands step() a closure and clips through its precision plugin."""

from __future__ import annotations

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from _common import ACCUM, CLIP, assert_same_params, params_of  # noqa: E402
from _lightning import BATCHES, AccumulatorRegressor, Regressor, fit, loader, trainer  # noqa: E402

pytestmark = pytest.mark.frameworks


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_lightning_fused_adamw_and_our_clip_equal_torch(precision: str) -> None:
    start = params_of(Regressor(fused=False))
    want = fit(Regressor(fused=False), precision, accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP)
    got = fit(Regressor(fused=True, our_clip=True), precision, accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP)
    assert_same_params(got, want, start)


def test_lightning_own_clipping_with_fused_adamw_at_fp32() -> None:
    """At precision 32 Lightning's own clip_gradients (torch's clip_grad_norm_) runs before our step."""
    start = params_of(Regressor(fused=False))
    want = fit(Regressor(fused=False), "32", accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP)
    got = fit(Regressor(fused=True), "32", accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP)
    assert_same_params(got, want, start)


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_lightning_fused_adamw_clipping_inside_its_step(precision: str) -> None:
    """FusedAdamW(max_grad_norm=...) without gradient_clip_val: the route Lightning leaves open under
    mixed precision, where it refuses gradient_clip_val for any optimizer that unscales in its step."""
    start = params_of(Regressor(fused=False))
    want = fit(Regressor(fused=False), precision, accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP)
    got = fit(Regressor(fused=True, max_grad_norm=CLIP), precision, accumulate_grad_batches=ACCUM)
    assert_same_params(got, want, start)


def test_lightning_fp16_grad_scaler_handshake() -> None:
    """16-mixed with a CPU GradScaler: Lightning skips unscale_ for an optimizer that unscales in its
    step and calls scaler.step, which hands FusedAdamW grad_scale and found_inf."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    start = params_of(Regressor(fused=False))
    plugin = [MixedPrecision("16-mixed", "cpu", scaler=scalers[0])]
    want = fit(Regressor(fused=False), None, plugins=plugin, accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP)
    plugin = [MixedPrecision("16-mixed", "cpu", scaler=scalers[1])]
    got = fit(Regressor(fused=True, max_grad_norm=CLIP), None, plugins=plugin, accumulate_grad_batches=ACCUM)
    assert_same_params(got, want, start)
    for scaler in scalers:  # scaling ran: three windows, no overflow, so three unskipped updates
        assert scaler.state_dict()["_growth_tracker"] == 3 and scaler.get_scale() == 2.0**10


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
@pytest.mark.parametrize("fused", [False, True], ids=["torch-adamw", "fused-adamw"])
def test_lightning_gradient_accumulator_callback_equals_accumulate_grad_batches(precision: str, fused: bool) -> None:
    from gradacc_ext import GradientAccumulationConfig
    from gradacc_ext.integrations.lightning import GradientAccumulatorCallback

    start = params_of(Regressor(fused=False))
    want = fit(Regressor(fused=False), precision, accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP)
    callback = GradientAccumulatorCallback(GradientAccumulationConfig(accumulation_steps=ACCUM, max_grad_norm=CLIP))
    module = AccumulatorRegressor(fused)
    t = trainer(precision, callbacks=[callback])
    t.fit(module, loader())
    assert_same_params(params_of(module), want, start)
    assert t.global_step == BATCHES // ACCUM and callback.accumulator.optimizer_steps == BATCHES // ACCUM


def test_lightning_gradient_accumulator_callback_refuses_automatic_optimisation() -> None:
    from gradacc_ext import GradientAccumulationConfig
    from gradacc_ext.integrations.lightning import GradientAccumulatorCallback

    callback = GradientAccumulatorCallback(GradientAccumulationConfig(accumulation_steps=ACCUM))
    with pytest.raises(ValueError, match="automatic_optimization = False"):
        trainer("32", callbacks=[callback]).fit(Regressor(fused=True), loader())


def test_lightning_gradient_accumulator_callback_max_steps_counts_windows() -> None:
    """Each closed window is one trainer.global_step: max_steps=2 stops after two windows (8 batches)."""
    from gradacc_ext import GradientAccumulationConfig
    from gradacc_ext.integrations.lightning import GradientAccumulatorCallback

    callback = GradientAccumulatorCallback(GradientAccumulationConfig(accumulation_steps=ACCUM))
    module = AccumulatorRegressor(fused=True)
    seen: list[int] = []
    module.on_train_batch_start = lambda batch, batch_idx: seen.append(batch_idx)
    t = trainer("32", callbacks=[callback], max_steps=2)
    t.fit(module, loader())
    assert t.global_step == 2 and callback.accumulator.optimizer_steps == 2 and seen == list(range(2 * ACCUM))


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_lightning_gradient_accumulator_callback_checkpoint_resume(tmp_path, state_dtype) -> None:
    """Two epochs at once equal one epoch, Lightning's checkpoint, and a resumed second epoch: the
    checkpoint holds FusedAdamW's state (int8: codes, scales and map names), the scheduler's and the
    accumulator's (the callback's)."""
    from gradacc_ext import GradientAccumulationConfig
    from gradacc_ext.integrations.lightning import GradientAccumulatorCallback

    def run(max_epochs: int, ckpt_path=None) -> tuple[AccumulatorRegressor, pl.Trainer]:
        config = GradientAccumulationConfig(accumulation_steps=ACCUM, max_grad_norm=CLIP)
        module = AccumulatorRegressor(fused=True, state_dtype=state_dtype)
        t = trainer("32", max_epochs=max_epochs, callbacks=[GradientAccumulatorCallback(config)])
        t.fit(module, loader(), ckpt_path=ckpt_path)
        return module, t

    start = params_of(Regressor(fused=False))
    whole, _ = run(2)
    first, t = run(1)
    t.save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed, t = run(2, ckpt_path=tmp_path / "epoch1.ckpt")
    assert not torch.equal(params_of(first)["net.0.weight"], params_of(whole)["net.0.weight"])
    assert_same_params(params_of(resumed), params_of(whole), start)
    weight = resumed.net[0].weight
    assert resumed.accumulator.optimizer.state[weight]["exp_avg"].dtype == (
        torch.uint8 if state_dtype == "int8" else torch.float32
    )
    assert t.global_step == 2 * BATCHES // ACCUM and resumed.accumulator.optimizer_steps == 2 * BATCHES // ACCUM
