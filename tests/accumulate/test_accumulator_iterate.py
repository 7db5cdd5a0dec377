"""acc.iterate(loader): the loader's last batch closes the (short) window, as micro_step(last=True) does.

One process here; under FSDP2/HSDP (where flush() cannot close a short window) it is tested in
test_fsdp.py, under DDP overlap in test_ddp_overlap.py.
"""

from __future__ import annotations

import pytest
import torch
from _cases import accumulator_run, make_batches, make_model, make_optimizer, mse

from gradacc_ext.accumulate.accumulator import GradientAccumulator
from gradacc_ext.accumulate.config import GradientAccumulationConfig

STEPS = 3


def build(seed: int) -> GradientAccumulator:
    model = make_model(torch.float64, seed)
    config = GradientAccumulationConfig(accumulation_steps=STEPS, max_grad_norm=0.4)
    return GradientAccumulator(model, make_optimizer("adamw", model.parameters(), dtype=torch.float64), config)


@pytest.mark.parametrize("num_batches", [7, 6])  # a short last window of 1; none
def test_last_batch_closes_the_window_like_flush(num_batches):
    seed = 31 + num_batches
    batches = make_batches(num_batches, 4, torch.float64, seed)
    acc, flushed = build(seed), build(seed)
    synced, closed = [], []
    for batch in acc.iterate(batches):
        synced.append(acc.sync_gradients)
        with acc.micro_step():
            closed.append(acc.backward(mse(acc.module, batch)))
    assert closed == synced == [(i + 1) % STEPS == 0 or i + 1 == num_batches for i in range(num_batches)]
    assert not acc.sync_gradients and acc.micro_steps_in_window == 0
    assert acc.flush() is False  # nothing left
    accumulator_run(flushed, batches)
    assert acc.optimizer_steps == flushed.optimizer_steps == -(-num_batches // STEPS)
    for p, q in zip(acc.module.parameters(), flushed.module.parameters(), strict=True):
        assert torch.equal(p, q)  # the same window end, bit for bit


def test_leaving_the_loop_early_clears_the_mark():
    batches = make_batches(4, 2, torch.float64, 41)
    acc = build(41)
    for i, batch in enumerate(acc.iterate(batches)):
        if i == 3:  # the last batch, marked: leave without running it
            assert acc.sync_gradients
            break
        acc.step_batch(batch, mse)
    assert not acc.sync_gradients and acc.micro_steps_in_window == 0  # batches 0-2 closed one window

    with pytest.raises(RuntimeError, match="injected"):
        for i, batch in enumerate(acc.iterate(batches)):
            acc.step_batch(batch, mse)
            if i == 3:
                raise RuntimeError("injected")
    assert not acc.sync_gradients  # the generator was closed on the way out
    assert list(acc.iterate([])) == []


@pytest.mark.parametrize("loader", [5, None])
def test_a_non_iterable_loader_is_refused_at_the_call(loader):
    acc = build(5)
    with pytest.raises(TypeError, match=r"iterate: loader must be an iterable of batches .* got (int|NoneType)$"):
        acc.iterate(loader)  # not only once the loop starts
    assert not acc.sync_gradients
