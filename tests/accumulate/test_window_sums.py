"""WindowSums, the window's sums as a transaction: commit keeps, rollback restores the last commit bit for bit
(or, where that cannot be exact, discards the window and says so), including views shown as .grad."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from _cases import FailInBackward, make_batches, make_model

from gradacc_ext.accumulate.accumulator import GradientAccumulator
from gradacc_ext.accumulate.buffers import GradBuffers
from gradacc_ext.accumulate.config import GradientAccumulationConfig

F64 = torch.float64


def make_sums(seed: int):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=F64)) for s in ((3, 4), (5,), (2, 2), (7,))]
    buffers = GradBuffers(params, None, "torch")  # owns its sums (which refer back to it weakly): kept alive here
    return buffers, buffers.sums, g


def grads(g: torch.Generator, sums, index) -> list[torch.Tensor]:
    return [torch.randn(sums.buffers.params[i].shape, generator=g, dtype=F64) for i in index]


def held(sums) -> list[torch.Tensor]:
    return [sums.view(i).clone() for i in sums.indices()]


def test_rollback_of_first_writes_restores_the_last_commit_bit_for_bit():
    _buffers, sums, g = make_sums(1)
    sums.begin()
    sums.add([0, 1], grads(g, sums, [0, 1]), 0.5)
    sums.commit()
    before = held(sums)
    sums.begin()
    new = grads(g, sums, [2, 3])
    sums.add([2], new[:1], 0.25)  # first writes of this micro-step ...
    view, beta = sums.write_directly(3)
    assert beta == 0.0
    view.copy_(new[1])
    sums.add([3], new[1:], 1.0)  # ... and an addition into one of them (a tied weight's second use): undoable
    assert sums.rollback()
    assert sums.indices() == [0, 1]
    for a, b in zip(held(sums), before, strict=True):
        assert torch.equal(a, b)
    # The next micro-step's first write to 2 assigns: the rolled-back values are never read.
    sums.begin()
    again = grads(g, sums, [2])
    sums.add([2], again, 2.0)
    sums.commit()
    assert torch.equal(sums.view(2), 2.0 * again[0])


def test_commit_keeps_and_an_addition_into_an_earlier_sum_discards_the_window():
    _buffers, sums, g = make_sums(2)
    sums.begin()
    first = grads(g, sums, [0, 1])
    sums.add([0, 1], first, 1.0)
    sums.commit()
    sums.begin()
    second = grads(g, sums, [0])
    sums.add([0], second, 1.0)
    sums.commit()
    assert sums.indices() == [0, 1]
    torch.testing.assert_close(sums.view(0), first[0] + second[0], rtol=0, atol=0)
    for write in (
        lambda: sums.add([1], grads(g, sums, [1]), 1.0),
        lambda: sums.write_directly(0),
        sums.writes_in_place,
    ):
        sums.begin()
        write()
        assert not sums.rollback()  # cannot be exact: no copy of the earlier sums is kept
        assert sums.indices() == []
        sums.begin()
        sums.add([0, 1], first, 1.0)
        sums.commit()


def test_rollback_shows_the_restored_views_as_grad_again():
    """grad_views: after a weight-1 micro-step .grad is the view; a weighted backward detaches it and fails before
    adding anything: the rollback is exact and .grad is the same view, holding the same sum, bit for bit."""
    model = make_model(F64, 5)
    (x1, y1), (x2, y2) = make_batches(2, 4, F64, 5)
    config = GradientAccumulationConfig(accumulation_steps=4, grad_views=True)
    with GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), config) as acc:
        with acc.micro_step():
            acc.backward(F.mse_loss(model(x1), y1))
        shown = [p.grad for p in model.parameters()]
        before = [g.clone() for g in shown]
        assert all(g is acc._sums.view(i) for i, g in enumerate(shown))
        failing = F.mse_loss(FailInBackward.apply(model(x2)), y2)  # fails before any parameter's gradient
        with pytest.raises(RuntimeError, match="injected"):
            acc._backprop.run(failing, 0.5, 0.5, weighted=False, completes_micro_batch=True, final=False)
        assert not acc._backprop.discarded and acc.micro_steps_in_window == 1
        assert all(p.grad is g for p, g in zip(model.parameters(), shown, strict=True))
        for g, b in zip(shown, before, strict=True):
            assert torch.equal(g, b)


def test_a_failed_first_micro_step_with_a_tied_fused_weight_is_rolled_back_exactly():
    """The fused head writes the tied weight first, the embedding's gradient is then added to it in the same
    micro-step, and the backward fails after that: only this micro-step's own writes, so the window is kept
    (before: discarded with a RuntimeWarning) and the run equals the plain loop."""
    torch.manual_seed(7)
    vocab, dim, n = 11, 6, 2

    def build() -> torch.nn.Module:
        torch.manual_seed(7)
        model = torch.nn.Sequential(torch.nn.Embedding(vocab, dim), torch.nn.Tanh(), torch.nn.Linear(dim, vocab))
        model[2].weight = model[0].weight
        return model.to(F64)

    def loss_of(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(ids[:-1]), ids[1:])

    model, ref = build(), build()
    data = [torch.randint(0, vocab, (9,)) for _ in range(2 * n)]
    config = GradientAccumulationConfig(accumulation_steps=n, gradient_accumulation_fusion=True)
    with GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.3), config) as acc:
        fail = [True]

        def after_our_fold(p: torch.Tensor) -> None:  # registered after the accumulator's hook: runs after its fold
            if fail.pop() if fail else False:
                raise RuntimeError("injected after the tied weight's second write")

        handle = model[0].weight.register_post_accumulate_grad_hook(after_our_fold)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "window was discarded"
            with pytest.raises(RuntimeError, match="injected"), acc.micro_step():
                acc.backward(loss_of(model, data[0]))
        handle.remove()
        assert acc._sums.indices() == [] and acc.micro_steps_in_window == 0
        for ids in data:
            with acc.micro_step():
                acc.backward(loss_of(model, ids))
    opt = torch.optim.SGD(ref.parameters(), lr=0.3)
    for start in range(0, len(data), n):
        opt.zero_grad()
        (sum(loss_of(ref, ids) for ids in data[start : start + n]) / n).backward()
        opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
