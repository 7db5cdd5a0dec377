"""Hugging Face Accelerate's accumulate() loop with our optimizer and clipping, and the same loop
migrated to GradientAccumulator as README shows ("An Accelerate-style loop"): both equal the plain
Accelerate loop (torch's AdamW, accelerator.clip_grad_norm_)."""

from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from _common import ACCUM, CLIP, assert_same_params, params_of, regression_data, tiny_mlp  # noqa: E402

import gradacc_ext.utils  # noqa: E402
from gradacc_ext import GradientAccumulationConfig, GradientAccumulator  # noqa: E402
from gradacc_ext.optim import FusedAdamW  # noqa: E402

pytestmark = pytest.mark.frameworks
BATCHES = 3 * ACCUM  # three windows: Accelerate divides a short last window by 4 as well, we by its size


def parts(fused: bool):
    model = tiny_mlp()
    cls = FusedAdamW if fused else torch.optim.AdamW
    opt = cls(model.parameters(), lr=3e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + step))
    loader = torch.utils.data.DataLoader(regression_data(BATCHES), batch_size=3, shuffle=False)
    return model, opt, sched, loader


def accelerate_loop(fused: bool, scaler: torch.amp.GradScaler | None = None) -> dict[str, torch.Tensor]:
    """README's "Before" loop; with fused=True the optimizer is FusedAdamW and the clip ours."""
    precision = "no" if scaler is None else "fp16"
    accelerate.state.AcceleratorState._reset_state(True)  # the settings are process-wide (accelerate's tests reset)
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=ACCUM, cpu=True, mixed_precision=precision)
    if scaler is not None:  # what Accelerator(mixed_precision="fp16") sets up on a GPU; on a CPU it does not
        accelerator.scaler, accelerator.native_amp = scaler, True
    model, opt, sched, loader = accelerator.prepare(*parts(fused))
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                if fused:
                    accelerator.unscale_gradients()  # what accelerator.clip_grad_norm_ does first (no-op unscaled)
                    gradacc_ext.utils.clip_grad_norm_(model.parameters(), CLIP)
                else:
                    accelerator.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            sched.step()
            opt.zero_grad()
    assert accelerator.step == 0  # every window closed on its own
    return params_of(accelerator.unwrap_model(model))


def migrated_loop(fused: bool) -> dict[str, torch.Tensor]:
    """README's "After" loop: the accumulator owns normalisation, clipping, step and schedule."""
    model, opt, sched, loader = parts(fused)
    acc = GradientAccumulator(
        model, opt, GradientAccumulationConfig(accumulation_steps=ACCUM, max_grad_norm=CLIP), sched
    )
    for x, y in loader:
        with acc.micro_step():
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
    acc.flush()
    assert acc.optimizer_steps == BATCHES // ACCUM
    return params_of(model)


@pytest.fixture(scope="module")
def plain() -> dict[str, torch.Tensor]:
    return accelerate_loop(fused=False)


def test_accelerate_loop_with_fused_adamw_and_our_clip(plain) -> None:
    assert_same_params(accelerate_loop(fused=True), plain, params_of(tiny_mlp()))


@pytest.mark.parametrize("fused", [False, True], ids=["torch-adamw", "fused-adamw"])
def test_accelerate_loop_migrated_to_gradient_accumulator(plain, fused: bool) -> None:
    assert_same_params(migrated_loop(fused), plain, params_of(tiny_mlp()))


def test_accelerate_loop_grad_scaler_unscale_then_step() -> None:
    """Accelerate's fp16 sequence: scaler.scale(loss).backward(), scaler.unscale_(opt) before the clip,
    then scaler.step(opt): GradScaler hands FusedAdamW found_inf and no scale (already unscaled)."""
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    want = accelerate_loop(fused=False, scaler=scalers[0])
    got = accelerate_loop(fused=True, scaler=scalers[1])
    assert_same_params(got, want, params_of(tiny_mlp()))
    for scaler in scalers:  # the scaler ran: one unskipped update per window
        assert scaler.state_dict()["_growth_tracker"] == BATCHES // ACCUM
