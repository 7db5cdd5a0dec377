"""The window's last fold gathers the norm (fold_norm.py): on the fused path in one process, with norm type 2 or
inf, the window end reads no buffer for the norm, except the views that fold did not write.

Counted, not timed: every tensor handed to ops.global_norm (the window end's norm pass) and every
ops.accumulate_final_ call (the last fold's buckets). The norm and the stepped parameters are checked
against a float64 computation of the plain full-batch loop's gradient.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _cases import IN, OUT, FailInBackward, OpCounter, assert_params_close, make_batches, make_model
from test_accumulator_fused import make_opt, plain_loop
from test_adaptive import OOMAbove, run

from gradacc_ext import GradientAccumulator
from gradacc_ext.accumulate.adaptive import AdaptiveGradientAccumulator
from gradacc_ext.accumulate.config import GradientAccumulationConfig

F32, F64 = torch.float32, torch.float64
NORMS = [pytest.param(2.0, id="l2"), pytest.param(math.inf, id="linf")]


class TwoBranch(torch.nn.Module):
    """The test model plus a branch that only some micro-steps use (its views miss some folds)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.main = make_model(F32, seed)
        self.extra = torch.nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor, use_extra: bool = True, fail_main: bool = False) -> torch.Tensor:
        main = self.main(x)
        if fail_main:
            main = FailInBackward.apply(main)
        return main + self.extra(x) if use_extra else main  # extra's backward runs first (created last)


def reference_norm(model: torch.nn.Module, batches, uses, norm_type: float) -> float:
    """The float64 norm of the full-batch mean gradient (each micro-batch's mean loss, averaged)."""
    ref = TwoBranch(0).to(F64)
    ref.load_state_dict(model.state_dict())
    loss = sum(F.mse_loss(ref(x.double(), use), y.double()) for (x, y), use in zip(batches, uses, strict=True))
    (loss / len(batches)).backward()
    grads = [p.grad.reshape(-1) for p in ref.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.cat(grads), norm_type).item()


def config(norm_type: float, steps: int, **more) -> GradientAccumulationConfig:
    return GradientAccumulationConfig(
        accumulation_steps=steps, fused_step=True, norm_type=norm_type, max_grad_norm=0.5, **more
    )


@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("bucket", [1, 1 << 20], ids=["per-param", "one-bucket"])
def test_the_window_end_reads_no_buffer_for_the_norm(monkeypatch, norm_type, bucket):
    """Every view is written by the last fold: its buckets carry the whole norm, no norm pass runs, and the
    windows step as the plain full-batch loop does (clipped)."""
    model, plain = TwoBranch(3), TwoBranch(3)
    batches = make_batches(6, 4, F32, 3)
    want = reference_norm(model, batches[:3], [True] * 3, norm_type)  # the first window's, before its step
    opt, plain_opt = make_opt("adamw", model.parameters(), F32), make_opt("adamw", plain.parameters(), F32)
    count = OpCounter(monkeypatch)
    norms = []
    with GradientAccumulator(model, opt, config(norm_type, 3, bucket_size_bytes=bucket)) as acc:
        for i, (x, y) in enumerate(batches):
            calls = count.final_calls
            acc.backward(F.mse_loss(model(x), y))
            last = i % 3 == 2
            assert (count.final_calls > calls) == last, "only the window's last micro-step gathers the norm"
            if last:
                norms.append(acc.window_state().grad_norm.item())
        assert count.norm_calls == 0 and count.norm_bytes == 0
        assert count.final_calls == (2 if bucket == 1 << 20 else 2 * 6)  # one call per bucket (6 params)
    sched = torch.optim.lr_scheduler.LambdaLR(plain_opt, lambda _: 1.0)
    plain_loop(plain, plain_opt, sched, batches, 3, max_grad_norm=0.5, norm_type=norm_type)
    assert_params_close(model, plain, F32)
    assert norms[0] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("norm_type", NORMS)
def test_only_the_views_the_last_fold_missed_take_the_pass(monkeypatch, norm_type):
    """`extra` gets no gradient in the last micro-step: its sums (from the first) are the only bytes the norm pass
    reads, and the norm is the whole gradient's."""
    model = TwoBranch(4)
    batches, uses = make_batches(2, 4, F32, 4), [True, False]
    want = reference_norm(model, batches, uses, norm_type)
    count = OpCounter(monkeypatch)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the parameters stay the reference's
    with GradientAccumulator(model, opt, config(norm_type, 2)) as acc:
        for (x, y), use in zip(batches, uses, strict=True):
            acc.backward(F.mse_loss(model(x, use), y))
        norm = acc.window_state().grad_norm.item()
    extra_bytes = sum(p.numel() * p.element_size() for p in model.extra.parameters())
    assert count.norm_calls == 1 and count.norm_bytes == extra_bytes
    assert norm == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("norm_type", NORMS)
def test_a_failed_last_micro_step_drops_its_partials_and_the_retry_gives_the_norm(monkeypatch, norm_type):
    """The last micro-step folds `extra` (first written there) with its partial, then fails: the rollback is exact
    and drops the partial with the write; the retried micro-step gathers the whole norm afresh."""
    model = TwoBranch(5)
    batches, uses = make_batches(2, 4, F32, 5), [False, True]
    want = reference_norm(model, batches, uses, norm_type)
    count = OpCounter(monkeypatch)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with GradientAccumulator(model, opt, config(norm_type, 2)) as acc:
        (x1, y1), (x2, y2) = batches
        acc.backward(F.mse_loss(model(x1, False), y1))
        with pytest.raises(RuntimeError, match="injected"):
            acc.backward(F.mse_loss(model(x2, True, fail_main=True), y2))
        assert count.final_calls == 2, "the failed last micro-step folded extra (weight, bias) with its partials"
        assert not acc._backprop.discarded and acc._sums.last_fold() is None
        acc.backward(F.mse_loss(model(x2, True), y2))
        norm = acc.window_state().grad_norm.item()
    assert count.norm_calls == 0
    assert norm == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("norm_type", NORMS)
def test_a_flushed_short_window_takes_the_pass_and_a_closing_micro_step_does_not(monkeypatch, norm_type):
    """flush(): the short window's last fold did not know it was last, so the window end takes the full pass;
    micro_step(last=True) tells the fold, and no pass runs."""
    model = TwoBranch(6)
    batches, uses = make_batches(2, 4, F32, 6), [True, True]
    want = reference_norm(model, batches, uses, norm_type)
    buffer_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for closing in (False, True):
        count = OpCounter(monkeypatch)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with GradientAccumulator(model, opt, config(norm_type, 4)) as acc:
            for i, (x, y) in enumerate(batches):
                with acc.micro_step(last=closing and i == 1):
                    acc.backward(F.mse_loss(model(x, True), y))
            assert acc.flush() is not closing
            norm = acc.window_state().grad_norm.item()
        assert count.norm_bytes == (0 if closing else buffer_bytes)
        assert norm == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("norm_type", NORMS)
def test_adaptive_chunks_of_the_last_micro_batch_gather_the_norm_in_the_completing_chunk(monkeypatch, norm_type):
    """The window's last micro-batch runs out of memory in backward and is split: only the chunk that completes it
    is the window's last fold; it writes every view, so the window end reads no buffer, and the norm is the unsplit
    run's."""
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(s, IN, generator=g), torch.randn(s, OUT, generator=g)) for s in (3, 8)]
    big, small = OOMAbove(F32, 7, limit=100), OOMAbove(F32, 7, limit=3, where="backward")
    norms = []
    for model, cls in ((big, GradientAccumulator), (small, AdaptiveGradientAccumulator)):
        count = OpCounter(monkeypatch)
        acc = cls(model, torch.optim.AdamW(model.parameters(), lr=0.05), config(norm_type, 2))
        assert run(acc, batches) == [False, True]
        assert count.norm_bytes == 0
        norms.append(acc.window_state().grad_norm.item())
        acc.close()
    assert small.ooms == 2 and small.net[0].weight.shape == big.net[0].weight.shape
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)
    assert_params_close(small, big, F32)


@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("mode", ["grad_views", "gradient_accumulation_fusion"])
def test_views_written_outside_the_fold_take_the_pass(monkeypatch, norm_type, mode):
    """grad_views (autograd adds into the views: no fold runs) and fused Linears (the GEMM writes the views): the
    last fold writes no view of this all-Linear model, so every view takes the norm pass, and the norm is right."""
    model = TwoBranch(8)
    batches, uses = make_batches(3, 4, F32, 8), [True, True, True]
    want = reference_norm(model, batches, uses, norm_type)
    count = OpCounter(monkeypatch)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with GradientAccumulator(model, opt, config(norm_type, 3, **{mode: True})) as acc:
        for (x, y), use in zip(batches, uses, strict=True):
            acc.backward(F.mse_loss(model(x, use), y))
        norm = acc.window_state().grad_norm.item()
    assert count.final_calls == 0
    assert count.norm_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert norm == pytest.approx(want, rel=1e-5)
