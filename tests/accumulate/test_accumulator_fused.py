"""config.fused_step: the window's tail as one fused optimizer pass, against the plain tail and the plain loop.

Each behaviour runs in both modes (fused_step=True: norm pass + adamw_step_/sgd_step_;
False: unscale, norm, clip passes + optimizer.step()): equivalence with the plain full-batch
loop, clipping (L2, inf, value), the fp16 overflow skip, the scheduler, resume mid-window, the
fallback and its reason, and bf16 params stepped from fp32 buffers without cast copies.
"""

from __future__ import annotations

import copy
import logging
import math
import zlib

import pytest
import torch
import torch.nn.functional as F
from _cases import (
    TOL,
    accumulator_run,
    assert_params_close,
    make_batches,
    make_model,
    make_scheduler,
    mse,
)
from test_accumulator_amp import fp32_forward, poison_hook

import gradacc_ext
from gradacc_ext import GradientAccumulator  # the one class of that name (the guides' entry points included)
from gradacc_ext.accumulate.buffers import GradBuffers
from gradacc_ext.accumulate.config import GradientAccumulationConfig
from gradacc_ext.optim import FusedAdamW, FusedLion, FusedSGD

MODES = [pytest.param(True, id="fused"), pytest.param(False, id="plain")]
OPTIMIZERS = ["adamw", "adam_amsgrad", "sgd_nesterov", "fused_adamw", "fused_sgd", "fused_lion"]


def make_opt(kind: str, params, dtype: torch.dtype) -> torch.optim.Optimizer:
    eps = 1e-3 if dtype == torch.float32 else 1e-8  # see test_accumulator.make_optimizer
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.02, weight_decay=0.05, eps=eps)
    if kind == "adam_amsgrad":
        return torch.optim.Adam(params, lr=0.02, eps=eps, amsgrad=True, maximize=True)
    if kind == "sgd_nesterov":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    if kind == "fused_adamw":
        return FusedAdamW(params, lr=0.02, weight_decay=0.05, eps=eps)
    if kind == "fused_lion":
        return FusedLion(params, lr=0.002, betas=(0.9, 0.99), weight_decay=0.1)
    return FusedSGD(params, lr=0.1, momentum=0.9, dampening=0.1)


def plain_loop(model, opt, sched, batches, n, max_grad_norm=None, norm_type=2.0, clip_value=None) -> None:
    """The full-batch loop: each window's micro-batches as one batch, torch's clipping, one step."""
    for start in range(0, len(batches), n):
        window = batches[start : start + n]
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(torch.cat([b[0] for b in window])), torch.cat([b[1] for b in window])).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm, norm_type)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        opt.step()
        sched.step()


def build(mode, kind, dtype, seed, **config):
    model = make_model(dtype, seed)
    opt = make_opt(kind, model.parameters(), dtype)
    sched = make_scheduler(opt)
    acc = GradientAccumulator(model, opt, GradientAccumulationConfig(fused_step=mode, **config), sched)
    return model, opt, sched, acc


def assert_path(acc: GradientAccumulator, mode: bool, windows: int) -> None:
    stats = acc.get_accumulation_stats()
    assert stats["fused_step"] is mode
    assert stats["fused_step_reason"] == ("" if mode else "config.fused_step=False")
    assert (acc._end.tail.calls if mode else 0) == (windows if mode else 0)  # one op call per window and group


CLIPS = {"none": {}, "l2": {"max_grad_norm": 0.3}, "inf": {"max_grad_norm": 0.05, "norm_type": math.inf}}
CLIPS["value"] = {"max_grad_norm": 0.3, "clip_value": 0.02}  # value clipping: a separate pass in both modes


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", OPTIMIZERS)
@pytest.mark.parametrize("clip", list(CLIPS))
def test_float64_equals_plain_loop(mode, kind, clip):
    n, dtype = 3, torch.float64
    seed = zlib.crc32(f"{mode}{kind}{clip}".encode()) % 10_000
    model, _, sched, acc = build(mode, kind, dtype, seed, accumulation_steps=n, **CLIPS[clip])
    batches = make_batches(8, 4, dtype, seed + 1)  # 3 + 3 + 2: the last window is short (flush)
    accumulator_run(acc, batches)
    ref = make_model(dtype, seed)
    ref_opt = make_opt(kind, ref.parameters(), dtype)
    plain_loop(ref, ref_opt, make_scheduler(ref_opt), batches, n, **CLIPS[clip])
    assert_params_close(model, ref, dtype)
    assert acc.optimizer_steps == 3 == sched.last_epoch and all(p.grad is None for p in model.parameters())
    assert_path(acc, mode, 3)


def test_float64_buffers_norm_and_clip_through_the_public_ops(monkeypatch):
    """The norm and clip ops take float64 lists (computed in double): float64 buffers call them, with the
    accumulator's backend, and keep a float64 path of their own only for accumulate_ and unscale_."""
    calls = []
    for name in ("global_norm", "clip_by_norm_", "clip_by_value_"):
        op = getattr(gradacc_ext.ops, name)

        def counted(tensors, *args, _op=op, _name=name, **kwargs):
            calls.append((_name, {t.dtype for t in tensors}, kwargs.get("backend")))
            return _op(tensors, *args, **kwargs)

        monkeypatch.setattr(gradacc_ext.ops, name, counted)
    _, _, _, acc = build(True, "fused_adamw", torch.float64, 7, accumulation_steps=2, **CLIPS["value"])
    accumulator_run(acc, make_batches(4, 4, torch.float64, 8))
    assert {name for name, _, _ in calls} == {"global_norm", "clip_by_norm_", "clip_by_value_"}
    assert all(dtypes == {torch.float64} and backend == acc.config.backend for _, dtypes, backend in calls)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_float32_equals_plain_loop_with_clipping(mode, kind):
    """fp32 buffers: the clip coefficient and the normaliser ride in the op's grad multiplier."""
    n, dtype, seed = 2, torch.float32, zlib.crc32(f"{mode}{kind}".encode()) % 10_000
    model, _, _, acc = build(mode, kind, dtype, seed, accumulation_steps=n, max_grad_norm=0.2)
    batches = make_batches(6, 5, dtype, seed + 1)
    accumulator_run(acc, batches)
    ref = make_model(dtype, seed)
    ref_opt = make_opt(kind, ref.parameters(), dtype)
    plain_loop(ref, ref_opt, make_scheduler(ref_opt), batches, n, max_grad_norm=0.2)
    assert_params_close(model, ref, dtype)
    assert_path(acc, mode, 3)
    if kind == "adamw":  # the user's optimizer holds torch's state, in torch's format
        mine, theirs = acc.optimizer.state_dict()["state"], ref_opt.state_dict()["state"]
        for key in ("step", "exp_avg", "exp_avg_sq"):
            for i in theirs:
                torch.testing.assert_close(mine[i][key], theirs[i][key], **TOL[dtype])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["adamw", "fused_adamw", "fused_lion"])
def test_fp16_overflow_skips_everything(mode, kind):
    """An inf in window 2: params, optimizer state and step counts bitwise unchanged, scheduler not stepped."""
    n, seed = 2, 5
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1000)
    model = make_model(torch.float32, seed)
    opt = make_opt(kind, model.parameters(), torch.float32)
    sched = make_scheduler(opt)
    config = GradientAccumulationConfig(
        accumulation_steps=n, mixed_precision="fp16", max_grad_norm=0.5, fused_step=mode
    )
    acc = GradientAccumulator(model, opt, config, sched, scaler=scaler)
    fp32_forward(acc)
    poison_hook(model[2].weight, {3})  # window 2's second micro-step
    batches = make_batches(3 * n, 4, torch.float32, seed)
    for batch in batches[:n]:
        with acc.micro_step():
            acc.backward(mse(model, batch))
    acc.synchronize()
    params, state = copy.deepcopy(list(model.parameters())), copy.deepcopy(opt.state_dict())
    for batch in batches[n : 2 * n]:
        with acc.micro_step():
            acc.backward(mse(model, batch))
    assert acc.last_step_skipped is True and acc.skipped_steps == 1 and sched.last_epoch == 1
    assert acc.loss_scale() == 128.0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))
    after = opt.state_dict()["state"]
    for i, saved in state["state"].items():
        assert all(torch.equal(after[i][k], v) for k, v in saved.items() if isinstance(v, torch.Tensor))
    for batch in batches[2 * n :]:  # the next window steps again, with the backed-off scale
        with acc.micro_step():
            acc.backward(mse(model, batch))
    assert acc.optimizer_steps == 2 and acc.last_step_skipped is False and sched.last_epoch == 2
    assert_path(acc, mode, 3)


@pytest.mark.parametrize("saved_mode", MODES)
def test_resume_mid_window_in_the_other_mode(saved_mode):
    """Save mid-window in one mode, resume in the other: the optimizer's state_dict serves both."""
    n, seed, dtype = 3, 23, torch.float64
    batches = make_batches(8, 4, dtype, seed)
    model, opt, sched, acc = build(saved_mode, "adamw", dtype, seed, accumulation_steps=n, max_grad_norm=0.4)
    for batch in batches[:4]:  # one window and one micro-step of the next
        with acc.micro_step():
            acc.backward(mse(model, batch))
    saved = copy.deepcopy(
        {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "acc": acc.state_dict()}
    )
    model2, opt2, sched2, acc2 = build(
        not saved_mode, "adamw", dtype, seed + 1, accumulation_steps=n, max_grad_norm=0.4
    )
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    acc2.load_state_dict(saved["acc"])
    accumulator_run(acc2, batches[4:])
    ref = make_model(dtype, seed)
    ref_opt = make_opt("adamw", ref.parameters(), dtype)
    plain_loop(ref, ref_opt, make_scheduler(ref_opt), batches, n, max_grad_norm=0.4)
    assert_params_close(model2, ref, dtype)
    assert acc2.optimizer_steps == 3 and sched2.last_epoch == 3


def test_fallback_says_why_once_and_true_refuses(caplog):
    model = make_model(torch.float32, 3)
    rmsprop = torch.optim.RMSprop(model.parameters(), lr=0.01)
    with caplog.at_level(logging.INFO, logger="gradacc_ext"):
        acc = GradientAccumulator(model, rmsprop, GradientAccumulationConfig(accumulation_steps=2))
        accumulator_run(acc, make_batches(4, 3, torch.float32, 3))
    stats = acc.get_accumulation_stats()
    assert stats["fused_step"] is False and "RMSprop is not FusedAdamW" in stats["fused_step_reason"]
    assert [r.getMessage() for r in caplog.records].count(
        "GradientAccumulator: fused_step='auto' falls back to optimizer.step(): " + stats["fused_step_reason"]
    ) == 1
    assert acc.optimizer_steps == 2
    acc.close()
    cases = [
        (torch.optim.RMSprop(model.parameters()), "RMSprop is not"),
        (torch.optim.Adam(model.parameters(), weight_decay=0.1), "L2"),
        (FusedAdamW(model.parameters(), max_grad_norm=1.0), "max_grad_norm"),
        (torch.optim.AdamW(make_model(torch.float32, 4).bfloat16().parameters()), "bfloat16"),
    ]
    hooked = torch.optim.SGD(model.parameters(), lr=0.1)
    hooked.register_step_post_hook(lambda *args: None)
    cases.append((hooked, "step hooks"))
    for opt, why in cases:
        params = [p for g in opt.param_groups for p in g["params"]]
        with pytest.raises(ValueError, match=f"fused_step=True, but the optimizer cannot take it: .*{why}"):
            GradientAccumulator(params, opt, GradientAccumulationConfig(accumulation_steps=2, fused_step=True))
    with pytest.raises(ValueError, match="GradientAccumulationConfig.fused_step must be 'auto', True or False"):
        GradientAccumulationConfig(accumulation_steps=2, fused_step="yes")


# Lion's update is +-lr per element: lr 1e-3 keeps a sign that bf16 rounding flips within the bf16-level tolerance
BF16_FUSED = {"adamw": lambda ps: FusedAdamW(ps, lr=0.01, eps=1e-3), "lion": lambda ps: FusedLion(ps, lr=1e-3)}


@pytest.mark.parametrize("kind", list(BF16_FUSED))
def test_bf16_params_step_from_fp32_buffers_without_cast_copies(monkeypatch, kind):
    """FusedAdamW's / FusedLion's master weights follow an fp32 run; no param-dtype gradient copy is ever made."""
    n, seed = 2, 31
    monkeypatch.setattr(GradBuffers, "expose", lambda self: pytest.fail("the fused tail made cast copies"))
    model = make_model(torch.float32, seed).bfloat16()
    ref = make_model(torch.float32, seed)
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})  # same (bf16-exact) start
    opt = BF16_FUSED[kind](model.parameters())
    acc = GradientAccumulator(model, opt, GradientAccumulationConfig(accumulation_steps=n, max_grad_norm=0.5))
    batches = make_batches(4 * n, 4, torch.float32, seed)
    for batch in batches:
        with acc.micro_step():
            acc.backward(mse(model, (batch[0].bfloat16(), batch[1].bfloat16())))
        assert all(p.grad is None for p in model.parameters())
        assert [(d, f.numel()) for d, f in acc._buffers.flats.items()] == [
            (torch.float32, sum(-(-p.numel() // 4) * 4 for p in model.parameters()))
        ]
    ref_opt = BF16_FUSED[kind](ref.parameters())
    plain_loop(ref, ref_opt, make_scheduler(ref_opt), batches, n, max_grad_norm=0.5)
    masters = [opt.state[p]["master_param"] for p in model.parameters()]
    assert all(m.dtype == torch.float32 for m in masters)
    for m, q in zip(masters, ref.parameters(), strict=True):  # bf16 forward/backward: bf16-level agreement
        torch.testing.assert_close(m, q, rtol=0.05, atol=0.02)
    assert_path(acc, True, 4)
