"""fp16 loss scaling (overflow skip, backoff, constant scale in a window), resume mid-window, misuse, CUDA AMP."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from _cases import (
    TOL,
    accumulator_run,
    assert_params_close,
    make_batches,
    make_model,
    make_optimizer,
    make_scheduler,
    mse,
    reference_run,
)

from gradacc_ext.accumulate.accumulator import GradientAccumulator
from gradacc_ext.accumulate.config import GradientAccumulationConfig

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")


def fp32_forward(acc: GradientAccumulator) -> None:
    """Runs the forward without autocast, so a test checks the loss scaling alone against fp32 math.

    (An fp16 forward rounds differently per micro-batch than per full batch; autocast itself is
    exercised by the CUDA tests.)
    """
    acc._autocast = contextlib.nullcontext


def poison_hook(param: torch.nn.Parameter, when: set[int]):
    """Makes param's gradient inf on the micro-steps listed in `when` (counted from 0)."""
    calls = [0]

    def hook(grad):
        i = calls[0]
        calls[0] += 1
        return grad * math.inf if i in when else grad

    return param.register_hook(hook)


@pytest.mark.parametrize("fused", [False, True])
def test_fp16_overflow_skips_step_backs_off_and_keeps_scheduler(fused):
    seed, n = 7, 3
    model = make_model(torch.float32, seed)
    opt = make_optimizer("adamw", model.parameters(), fused=fused)
    sched = make_scheduler(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    # fused_step=False: the plain tail, with torch's fused AdamW when fused (test_accumulator_fused has the fused tail).
    config = GradientAccumulationConfig(
        accumulation_steps=n, mixed_precision="fp16", max_grad_norm=1.0, fused_step=False
    )
    acc = GradientAccumulator(model, opt, config, sched, scaler=scaler)
    fp32_forward(acc)
    batches = make_batches(2 * n, 4, torch.float32, seed)
    poison_hook(model[0].weight, {1})  # the middle micro-step of the first window
    before = [p.detach().clone() for p in model.parameters()]
    scales = []
    for batch in batches[:n]:
        with acc.micro_step():
            acc.backward(mse(model, batch))
        scales.append(acc.loss_scale())
    assert scales[:2] == [1024.0, 1024.0]  # constant while the window accumulates
    assert acc.last_step_skipped is True and acc.skipped_steps == 1 and acc.optimizer_steps == 0
    assert acc.loss_scale() == 512.0  # backed off once
    assert sched.last_epoch == 0  # the scheduler did not step
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert not opt.state or all(float(s["step"]) == 0 for s in opt.state.values())
    # The next window starts from clean buffers and equals a plain step from the unchanged parameters.
    ref = make_model(torch.float32, seed)
    ref_opt = make_optimizer("adamw", ref.parameters())
    ref_sched = make_scheduler(ref_opt)
    for batch in batches[n:]:
        with acc.micro_step():
            acc.backward(mse(model, batch))
    acc.flush()
    reference_run(ref, ref_opt, ref_sched, batches[n:], n, max_norm=1.0)
    assert_params_close(model, ref, torch.float32)
    assert acc.optimizer_steps == 1 and sched.last_epoch == 1


def test_fp16_own_scaler_grows_after_interval():
    model = make_model(torch.float32, 3)
    config = GradientAccumulationConfig(
        accumulation_steps=2, mixed_precision="fp16", init_scale=256.0, growth_interval=2
    )
    acc = GradientAccumulator(model, make_optimizer("sgd", model.parameters()), config)
    accumulator_run(acc, make_batches(4, 3, torch.float32, 3))
    assert acc.loss_scale() == 512.0 and acc.optimizer_steps == 2


def test_fp16_equals_fp32_reference_with_scaled_loss():
    """Scaling by 2**k then unscaling in the final pass is exact in fp32: the result equals the unscaled run."""
    seed, n = 17, 3
    runs = {}
    for mode in ("no", "fp16"):
        model = make_model(torch.float32, seed)
        config = GradientAccumulationConfig(accumulation_steps=n, mixed_precision=mode, max_grad_norm=0.5)
        acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.2), config)
        fp32_forward(acc)
        accumulator_run(acc, make_batches(7, 4, torch.float32, seed))
        runs[mode] = model
    assert_params_close(runs["fp16"], runs["no"], torch.float32)


@pytest.mark.parametrize("mode", ["mean", "sum"])
def test_resume_mid_window_equals_uninterrupted(mode, tmp_path):
    dtype, n, seed = torch.float64, 3, 23
    batches = make_batches(8, 3, dtype, seed)
    config = GradientAccumulationConfig(accumulation_steps=n, loss_normalization=mode, max_grad_norm=0.4)

    def build():
        model = make_model(dtype, seed)
        opt = make_optimizer("adamw", model.parameters())
        sched = make_scheduler(opt)
        return model, opt, sched, GradientAccumulator(model, opt, config, sched)

    def feed(acc, model, chunk):
        for x, y in chunk:
            with acc.micro_step():
                loss = F.mse_loss(model(x), y, reduction=mode)
                acc.backward(loss, num_items=torch.tensor(y.numel()) if mode == "sum" else None)

    model, _, _, acc = build()
    feed(acc, model, batches)
    acc.flush()
    cut = 4  # mid-window: one micro-step into the second window
    model1, opt1, sched1, acc1 = build()
    feed(acc1, model1, batches[:cut])
    assert acc1.micro_steps_in_window == 1
    path = tmp_path / "ckpt.pt"
    torch.save(
        {
            "model": model1.state_dict(),
            "opt": opt1.state_dict(),
            "sched": sched1.state_dict(),
            "acc": acc1.state_dict(),
        },
        path,
    )
    state = torch.load(path, weights_only=False)
    model2, opt2, sched2, acc2 = build()
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    sched2.load_state_dict(state["sched"])
    acc2.load_state_dict(state["acc"])
    feed(acc2, model2, batches[cut:])
    acc2.flush()
    assert_params_close(model2, model, dtype)
    assert acc2.optimizer_steps == acc.optimizer_steps == 3 and acc2.stats.micro_steps == 8


def test_resume_restores_loss_scale():
    model = make_model(torch.float32, 1)
    config = GradientAccumulationConfig(accumulation_steps=2, mixed_precision="fp16", init_scale=64.0)
    acc = GradientAccumulator(model, make_optimizer("sgd", model.parameters()), config)
    poison_hook(model[2].bias, {0})
    accumulator_run(acc, make_batches(3, 2, torch.float32, 1)[:2])
    assert acc.loss_scale() == 32.0
    state = acc.state_dict()
    acc.close()
    fresh = GradientAccumulator(model, make_optimizer("sgd", model.parameters()), config)
    fresh.load_state_dict(state)
    assert fresh.loss_scale() == 32.0 and fresh.skipped_steps == 1


def test_load_state_dict_rejects_mismatches():
    model = make_model(torch.float32, 2)
    acc = GradientAccumulator(
        model, make_optimizer("sgd", model.parameters()), GradientAccumulationConfig(accumulation_steps=2)
    )
    state = acc.state_dict()
    acc.close()
    other = GradientAccumulator(
        model, make_optimizer("sgd", model.parameters()), GradientAccumulationConfig(accumulation_steps=3)
    )
    with pytest.raises(ValueError, match="accumulation_steps=2"):
        other.load_state_dict(state)
    other.close()
    small = make_model(torch.float32, 2)[:1]
    with pytest.raises(ValueError, match="do not match"):
        GradientAccumulator(
            small, make_optimizer("sgd", small.parameters()), GradientAccumulationConfig(accumulation_steps=2)
        ).load_state_dict(state)


def test_misuse_errors():
    model = make_model(torch.float32, 4)
    opt = make_optimizer("sgd", model.parameters())
    acc = GradientAccumulator(model, opt, GradientAccumulationConfig(accumulation_steps=2))
    batch = make_batches(1, 2, torch.float32, 4)[0]
    with pytest.raises(TypeError, match="optimizer must be"):
        GradientAccumulator(model, "sgd", GradientAccumulationConfig(accumulation_steps=2))
    with pytest.raises(ValueError, match="no trainable parameters"):
        GradientAccumulator(
            torch.nn.Linear(2, 2).requires_grad_(False), opt, GradientAccumulationConfig(accumulation_steps=2)
        )
    with pytest.raises(ValueError, match="requires grad"):
        acc.backward(mse(model, batch).detach())
    with pytest.raises(RuntimeError, match="twice inside one micro_step"):
        with acc.micro_step():
            acc.backward(mse(model, batch))
            acc.backward(mse(model, batch))
    with pytest.raises(RuntimeError, match="cannot be nested"):
        with acc.micro_step(), acc.micro_step():
            pass
    with pytest.raises(RuntimeError, match="inside micro_step"):
        with acc.micro_step():
            acc.flush()
    acc.close()
    sums = GradientAccumulationConfig(accumulation_steps=2, loss_normalization="sum")
    with GradientAccumulator(model, opt, sums) as a:
        with pytest.raises(ValueError, match="num_items is required"):
            a.backward(mse(model, batch))
    with GradientAccumulator(model, opt, GradientAccumulationConfig(accumulation_steps=3)) as mixed:
        mixed.backward(mse(model, batch))
        with pytest.raises(ValueError, match="every micro-batch of a window or for none"):
            mixed.backward(mse(model, batch), num_items=2)
    with GradientAccumulator(model, opt, GradientAccumulationConfig(accumulation_steps=2)) as a:
        with pytest.raises(ValueError, match="num_items must be an int >= 0"):
            a.backward(mse(model, batch), num_items=-1)


def test_double_flush_and_failed_micro_step_leave_state_clean():
    """flush() on an empty window is a no-op returning False; a micro-step that raises leaves the window as it was."""
    dtype, seed = torch.float64, 33
    model, ref = make_model(dtype, seed), make_model(dtype, seed)
    batches = make_batches(3, 3, dtype, seed)
    acc = GradientAccumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.3), GradientAccumulationConfig(accumulation_steps=4)
    )
    with acc.micro_step():
        acc.backward(mse(model, batches[0]))
    with pytest.raises(ZeroDivisionError):
        with acc.micro_step():
            mse(model, batches[1]).backward()  # a partial gradient the accumulator must drop
            raise ZeroDivisionError
    assert all(p.grad is None for p in model.parameters()) and acc.micro_steps_in_window == 1
    for batch in batches[1:]:
        with acc.micro_step():
            acc.backward(mse(model, batch))
    assert acc.flush() is True
    assert acc.flush() is False and acc.optimizer_steps == 1
    reference_run(ref, torch.optim.SGD(ref.parameters(), lr=0.3), None, batches, 4)
    assert_params_close(model, ref, dtype)


@CUDA
@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_cuda_amp_matches_fp32_reference_loosely(mode):
    """On CUDA: autocast forward, fp16 loss scaling or bf16; no host sync per micro-step."""
    seed, n = 5, 4
    model = make_model(torch.float32, seed).cuda()
    ref = make_model(torch.float32, seed).cuda()
    batches = [(x.cuda(), y.cuda()) for x, y in make_batches(8, 16, torch.float32, seed)]
    opt = make_optimizer("adamw", model.parameters(), fused=True)
    acc = GradientAccumulator(
        model, opt, GradientAccumulationConfig(accumulation_steps=n, mixed_precision=mode, max_grad_norm=1.0)
    )
    for i, batch in enumerate(batches):
        final = (i + 1) % n == 0
        torch.cuda.set_sync_debug_mode("default" if final else "error")
        try:
            with acc.micro_step():
                acc.backward(mse(model, batch))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    reference_run(ref, make_optimizer("adamw", ref.parameters()), None, batches, n, max_norm=1.0)
    assert acc.optimizer_steps + acc.skipped_steps == 2
    if acc.skipped_steps == 0:
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0.05, atol=0.02)


@CUDA
def test_cuda_bf16_params_fp32_buffers_matches_float64_mean():
    seed, n = 9, 4
    model = make_model(torch.float32, seed).cuda().bfloat16()
    acc = GradientAccumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.0), GradientAccumulationConfig(accumulation_steps=n)
    )
    grads = []
    acc.optimizer.register_step_pre_hook(lambda *_: grads.append([p.grad.float().clone() for p in model.parameters()]))
    batches = [(x.cuda().bfloat16(), y.cuda()) for x, y in make_batches(n, 8, torch.float32, seed)]
    sums = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x).float(), y).backward()
        for s, p in zip(sums, model.parameters(), strict=True):
            s += p.grad.double()
        model.zero_grad(set_to_none=True)
        with acc.micro_step():
            acc.backward(F.mse_loss(model(x).float(), y))
    for g, s in zip(grads[0], sums, strict=True):
        torch.testing.assert_close(g.double(), (s / n).bfloat16().double(), **TOL[torch.float32], check_dtype=False)
