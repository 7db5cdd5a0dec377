"""GradientAccumulator against a plain full-batch loop: normalisation, clipping, counting, schedulers, dtypes.

The models are float64 where exactness is the point (the accumulator then runs
the reference ops in float64, so tolerances are ~1e-12), and float32 for the
compiled-kernel path. Every test draws fresh random data.
"""

from __future__ import annotations

import copy
import math
import zlib

import pytest
import torch
import torch.nn.functional as F
from _cases import (
    IN,
    OUT,
    TOL,
    accumulator_run,
    assert_params_close,
    make_batches,
    make_model,
    make_optimizer,
    make_scheduler,
    max_param_diff,
    mse,
    padded_batches,
    reference_run,
    token_sum,
)

from gradacc_ext import GradientAccumulator  # the one class of that name (the guides' entry points included)
from gradacc_ext.accumulate.config import GradientAccumulationConfig


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("opt_kind", ["sgd", "adamw"])
@pytest.mark.parametrize("clip", [None, (0.3, 2.0), (0.05, math.inf)])
def test_matches_full_batch(dtype, opt_kind, clip):
    n, num_batches = 3, 8  # 8 = 3 + 3 + 2: the last window is short
    seed = zlib.crc32(f"{dtype}{opt_kind}{clip}".encode()) % 10_000
    model, ref = make_model(dtype, seed), make_model(dtype, seed)
    batches = make_batches(num_batches, 4, dtype, seed + 1)
    max_norm, norm_type = clip if clip else (None, 2.0)
    opt = make_optimizer(opt_kind, model.parameters(), dtype=dtype)
    sched = make_scheduler(opt)
    config = GradientAccumulationConfig(accumulation_steps=n, max_grad_norm=max_norm, norm_type=norm_type)
    acc = GradientAccumulator(model, opt, config, sched)
    closed = accumulator_run(acc, batches)
    ref_opt = make_optimizer(opt_kind, ref.parameters(), dtype=dtype)
    ref_sched = make_scheduler(ref_opt)
    reference_run(ref, ref_opt, ref_sched, batches, n, max_norm, norm_type)
    assert_params_close(model, ref, dtype)
    assert closed == [False, False, True, False, False, True, False, False, True]
    assert acc.optimizer_steps == math.ceil(num_batches / n) == sched.last_epoch == ref_sched.last_epoch
    assert acc.stats.micro_steps == num_batches and acc.skipped_steps == 0
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("fused", [False, True])
def test_fused_adamw_path_matches_and_defers_scheduler(fused):
    """fused=True gets found_inf as a tensor (no host sync); the scheduler still steps before the next step."""
    n, seed = 2, 11
    model, ref = make_model(torch.float32, seed), make_model(torch.float32, seed)
    batches = make_batches(7, 3, torch.float32, seed)
    opt = make_optimizer("adamw", model.parameters(), fused=fused)
    sched = make_scheduler(opt)
    # fused_step=False: torch's own fused step through GradScaler's protocol (the fused tail has its own tests).
    config = GradientAccumulationConfig(accumulation_steps=n, max_grad_norm=0.2, fused_step=False)
    acc = GradientAccumulator(model, opt, config, sched)
    assert acc._stepper.fused is fused
    for i, batch in enumerate(batches):
        with acc.micro_step():
            acc.backward(mse(model, batch))
        if fused and i == 1:
            # The first window's outcome is not read yet: the scheduler waits for the next step or a read.
            assert acc._stepper.pending is not None and sched.last_epoch == 0
    acc.flush()
    ref_opt = make_optimizer("adamw", ref.parameters())
    ref_sched = make_scheduler(ref_opt)
    reference_run(ref, ref_opt, ref_sched, batches, n, max_norm=0.2)
    assert_params_close(model, ref, torch.float32)
    assert sched.last_epoch == ref_sched.last_epoch == 4 == acc.optimizer_steps


def test_short_window_weighting_is_real_size_not_k_over_n():
    """Accelerate/Lightning divide a short last window by N (k/N); the accumulator must not, and the test can tell."""
    dtype, n, seed = torch.float64, 4, 5
    model, ref, wrong = make_model(dtype, seed), make_model(dtype, seed), make_model(dtype, seed)
    batches = make_batches(6, 3, dtype, seed)  # 4 + 2
    acc = GradientAccumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.5), GradientAccumulationConfig(accumulation_steps=n)
    )
    accumulator_run(acc, batches)
    reference_run(ref, torch.optim.SGD(ref.parameters(), lr=0.5), None, batches, n)
    reference_run(wrong, torch.optim.SGD(wrong.parameters(), lr=0.5), None, batches, n, short_weight="k/N")
    assert_params_close(model, ref, dtype)
    assert max_param_diff(model, wrong) > 1e6 * TOL[dtype]["atol"]


def test_accumulation_steps_one_is_the_plain_loop():
    dtype, seed = torch.float64, 21
    model, ref = make_model(dtype, seed), make_model(dtype, seed)
    batches = make_batches(5, 4, dtype, seed)
    opt = make_optimizer("adamw", model.parameters())
    acc = GradientAccumulator(model, opt, GradientAccumulationConfig(accumulation_steps=1, max_grad_norm=0.1))
    assert accumulator_run(acc, batches) == [True] * 5 + [False]
    ref_opt = make_optimizer("adamw", ref.parameters())
    for batch in batches:
        ref_opt.zero_grad()
        mse(ref, batch).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        ref_opt.step()
    assert_params_close(model, ref, dtype)


def test_counting_and_scheduler_only_on_real_steps():
    for n, num_batches in ((4, 10), (3, 9), (5, 3)):
        model = make_model(torch.float32, n)
        opt = make_optimizer("sgd", model.parameters())
        sched = make_scheduler(opt)
        acc = GradientAccumulator(model, opt, GradientAccumulationConfig(accumulation_steps=n), sched)
        closed = accumulator_run(acc, make_batches(num_batches, 2, torch.float32, n))
        assert sum(closed) == acc.optimizer_steps == sched.last_epoch == math.ceil(num_batches / n)
        assert acc.stats.micro_steps == num_batches
        assert len(acc.grad_norm_history()) == math.ceil(num_batches / n)


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("items_as_tensor", [False, True])
def test_token_weighted_equals_full_batch_token_mean(mode, items_as_tensor):
    """Transformers' 2024 bug: a mean of per-micro-batch token means is wrong with padding; ours is the token mean."""
    dtype, n, seed = torch.float64, 3, 31 + items_as_tensor
    model, ref, naive = make_model(dtype, seed), make_model(dtype, seed), make_model(dtype, seed)
    batches = padded_batches(7, seed, dtype)
    opt = make_optimizer("adamw", model.parameters())
    acc = GradientAccumulator(model, opt, GradientAccumulationConfig(accumulation_steps=n, loss_normalization=mode))
    for batch in batches:
        tokens = batch[2].sum()
        num_items = tokens.to(torch.int64) if items_as_tensor else int(tokens)
        with acc.micro_step():
            loss = token_sum(model, batch) if mode == "sum" else token_sum(model, batch) / tokens
            acc.backward(loss, num_items=num_items)
    acc.flush()
    ref_opt, naive_opt = make_optimizer("adamw", ref.parameters()), make_optimizer("adamw", naive.parameters())
    for start in range(0, len(batches), n):
        window = batches[start : start + n]
        ref_opt.zero_grad()
        (sum(token_sum(ref, b) for b in window) / sum(b[2].sum() for b in window)).backward()
        ref_opt.step()
        naive_opt.zero_grad()
        (sum(token_sum(naive, b) / b[2].sum() for b in window) / len(window)).backward()
        naive_opt.step()
    assert_params_close(model, ref, dtype)
    assert max_param_diff(model, naive) > 1e6 * TOL[dtype]["atol"]


def test_bf16_params_accumulate_in_fp32_buffers():
    seed, n = 41, 4
    model = make_model(torch.float32, seed).to(torch.bfloat16)
    batches = make_batches(8, 4, torch.float32, seed)
    acc = GradientAccumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), GradientAccumulationConfig(accumulation_steps=n)
    )
    assert acc._buffers.dtypes == [torch.float32]
    # The optimizer must see exactly fp32_sum(grads)/n rounded once to bf16: capture it with a step hook.
    seen = []
    acc.optimizer.register_step_pre_hook(lambda opt, *_: seen.append([p.grad.clone() for p in model.parameters()]))
    expected = []
    for start in range(0, 8, n):
        sums = [torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()]
        for batch in batches[start : start + n]:
            x, y = batch
            model.zero_grad()
            F.mse_loss(model(x.bfloat16()).float(), y).backward()
            for s, p in zip(sums, model.parameters(), strict=True):
                s += p.grad.double()
            model.zero_grad(set_to_none=True)
            with acc.micro_step():
                acc.backward(F.mse_loss(model(x.bfloat16()).float(), y))
        expected.append([(s / n).to(torch.bfloat16) for s in sums])
    flat = acc._buffers.flats[torch.float32]
    assert all(v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for v in acc._buffers.views)
    for got, want in zip(seen, expected, strict=True):
        for g, w in zip(got, want, strict=True):
            assert g.dtype == torch.bfloat16
            torch.testing.assert_close(g, w, rtol=2**-7, atol=1e-6)


def test_bf16_params_without_fp32_buffers_keep_param_dtype():
    model = make_model(torch.float32, 3).to(torch.bfloat16)
    acc = GradientAccumulator(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        GradientAccumulationConfig(accumulation_steps=2, accum_dtype=None),
    )
    assert acc._buffers.dtypes == [torch.bfloat16]
    accumulator_run(acc, [(x.bfloat16(), y.bfloat16()) for x, y in make_batches(4, 3, torch.float32, 3)])
    assert acc.optimizer_steps == 2


def test_frozen_params_excluded_and_unused_branch_is_zero_not_stale():
    """A parameter without a grad in some micro-steps contributes zero there; never used in a window: grad None."""
    dtype, n, seed = torch.float64, 3, 51

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = torch.nn.Linear(IN, OUT)
            self.branch = torch.nn.Linear(IN, OUT)
            self.frozen = torch.nn.Linear(IN, OUT)
            self.frozen.requires_grad_(False)

        def forward(self, x, use_branch):
            out = self.trunk(x) + self.frozen(x)
            return out + self.branch(x) if use_branch else out

    torch.manual_seed(seed)
    model = Branchy().to(dtype)
    ref = copy.deepcopy(model)
    frozen_before = model.frozen.weight.detach().clone()
    batches = make_batches(9, 3, dtype, seed)
    # Branch used: window 1 in the first and last micro-step, window 2 only in the middle one, window 3 never.
    use = [True, False, True, False, True, False, False, False, False]
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    acc = GradientAccumulator(model, opt, GradientAccumulationConfig(accumulation_steps=n))
    assert all(p is not model.frozen.weight for p in acc.params)
    for (x, y), u in zip(batches, use, strict=True):
        with acc.micro_step():
            acc.backward(F.mse_loss(model(x, u), y))
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=0.05, weight_decay=0.1)
    for start in range(0, 9, n):
        ref_opt.zero_grad(set_to_none=True)
        loss = sum(
            F.mse_loss(ref(x, u), y)
            for (x, y), u in zip(batches[start : start + n], use[start : start + n], strict=True)
        )
        (loss / n).backward()
        ref_opt.step()
    assert_params_close(model, ref, dtype)
    assert torch.equal(model.frozen.weight, frozen_before)


def test_params_iterable_and_sgd_without_module():
    dtype, seed = torch.float64, 61
    model, ref = make_model(dtype, seed), make_model(dtype, seed)
    batches = make_batches(4, 3, dtype, seed)
    acc = GradientAccumulator(
        model.parameters(),
        torch.optim.SGD(model.parameters(), lr=0.3),
        GradientAccumulationConfig(accumulation_steps=2),
    )
    for batch in batches:
        acc.backward(mse(model, batch))  # no micro_step() needed without a DDP model
    reference_run(ref, torch.optim.SGD(ref.parameters(), lr=0.3), None, batches, 2)
    assert_params_close(model, ref, dtype)


def test_step_batch_with_callable():
    dtype, seed = torch.float64, 71
    model, ref = make_model(dtype, seed), make_model(dtype, seed)
    batches = make_batches(6, 4, dtype, seed)
    acc = GradientAccumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.3), GradientAccumulationConfig(accumulation_steps=3)
    )
    closed = [acc.step_batch(batch, lambda m, b: (mse(m, b), b[0].shape[0])) for batch in batches]
    assert closed == [False, False, True] * 2
    reference_run(ref, torch.optim.SGD(ref.parameters(), lr=0.3), None, batches, 3)
    assert_params_close(model, ref, dtype)


def test_backend_auto_and_torch_agree_fp32():
    seed = 81
    runs = {}
    for backend in ("auto", "torch"):
        model = make_model(torch.float32, seed)
        acc = GradientAccumulator(
            model,
            make_optimizer("adamw", model.parameters()),
            GradientAccumulationConfig(accumulation_steps=3, max_grad_norm=0.1, clip_value=0.02, backend=backend),
        )
        accumulator_run(acc, make_batches(7, 5, torch.float32, seed))
        runs[backend] = model
    assert_params_close(runs["auto"], runs["torch"], torch.float32)


def test_clip_value_after_norm_clip():
    dtype, seed = torch.float64, 91
    model, ref = make_model(dtype, seed), make_model(dtype, seed)
    batches = make_batches(4, 3, dtype, seed)
    config = GradientAccumulationConfig(accumulation_steps=2, max_grad_norm=0.5, clip_value=0.01)
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=1.0), config)
    accumulator_run(acc, batches)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1.0)
    for start in (0, 2):
        ref_opt.zero_grad()
        (sum(mse(ref, b) for b in batches[start : start + 2]) / 2).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        torch.nn.utils.clip_grad_value_(ref.parameters(), 0.01)
        ref_opt.step()
    assert_params_close(model, ref, dtype)


def test_stats_callbacks_and_compat_dict():
    model = make_model(torch.float32, 101)
    acc = GradientAccumulator(
        model,
        make_optimizer("sgd", model.parameters()),
        GradientAccumulationConfig(accumulation_steps=2, micro_batch_size=3, target_batch_size=6),
    )
    events = []
    handle = acc.add_callback(events.append)
    results = [
        acc.accumulate_gradients(mse(model, b), model, acc.optimizer) for b in make_batches(5, 3, torch.float32, 101)
    ]
    assert [r["should_update"] for r in results] == [False, True, False, True, False]
    assert [r["accumulation_step"] for r in results] == [1, 2, 1, 2, 1]
    assert all(r["effective_batch_size"] == 6 for r in results)
    assert results[1]["grad_norm"] is not None and torch.isfinite(results[1]["grad_norm"])
    assert [e.step for e in events] == [1, 2] and all(e.micro_steps == 2 for e in events)
    handle.remove()
    acc.flush()
    assert len(events) == 2
    stats = acc.get_accumulation_stats()
    assert stats["optimizer_steps"] == stats["current_step"] == 3 and stats["micro_steps"] == 5
    assert stats["skipped_steps"] == 0 and stats["accumulation_step"] == 0
    assert len(stats["grad_norm_history"]) == 3 and stats["avg_gradient_norm"] > 0
    assert stats["time_per_step_s"] > 0 and stats["time_per_micro_step_s"] > 0
    with pytest.raises(ValueError, match="optimizer passed is not the one"):
        acc.accumulate_gradients(
            mse(model, make_batches(1, 3, torch.float32, 1)[0]), None, torch.optim.SGD(model.parameters(), lr=1)
        )


def test_grad_norm_history_is_a_ring():
    model = make_model(torch.float32, 111)
    acc = GradientAccumulator(
        model,
        make_optimizer("sgd", model.parameters()),
        GradientAccumulationConfig(accumulation_steps=1, grad_norm_history=3),
    )
    norms = []
    acc.add_callback(lambda info: norms.append(float(info.grad_norm)))
    accumulator_run(acc, make_batches(5, 2, torch.float32, 111))
    assert acc.grad_norm_history().tolist() == pytest.approx(norms[-3:])
