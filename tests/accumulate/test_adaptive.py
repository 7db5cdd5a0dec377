"""AdaptiveGradientAccumulator with an injected OOM: split, exact result, size kept, floor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _cases import TOL, OOMInBackward, assert_params_close, make_batches, padded_batches, token_sum

from gradacc_ext.accumulate.accumulator import GradientAccumulator
from gradacc_ext.accumulate.adaptive import AdaptiveGradientAccumulator, split_batch
from gradacc_ext.accumulate.config import GradientAccumulationConfig

IN, OUT = 5, 3


class OOMAbove(torch.nn.Module):
    """A model whose forward raises torch.OutOfMemoryError above `limit` items (or in backward, with where=...)."""

    def __init__(self, dtype: torch.dtype, seed: int, limit: int, where: str = "forward") -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(IN, 6), torch.nn.Tanh(), torch.nn.Linear(6, OUT)).to(dtype)
        self.limit, self.where, self.ooms = limit, where, 0

    def forward(self, x):
        if x.shape[0] > self.limit and self.where == "forward":
            self.ooms += 1
            raise torch.OutOfMemoryError(f"injected: {x.shape[0]} > {self.limit}")
        out = self.net(x)
        if x.shape[0] > self.limit and self.where == "backward":
            return OOMInBackward.apply(out, self)
        return out


def mean_loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def run(acc, batches, loss_fn=mean_loss):
    closed = [acc.step_batch(b, loss_fn) for b in batches]
    acc.flush()
    return closed


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_oom_split_equals_unsplit_run_and_size_is_kept(where):
    dtype, seed, n = torch.float64, 3, 2
    # Micro-batches of 8, 5, 8, 7: sizes that split unevenly (8 -> 4+4 -> ..., 5 -> 3+2, 7 -> 4+3).
    g = torch.Generator().manual_seed(seed)
    batches = [
        (torch.randn(s, IN, generator=g, dtype=dtype), torch.randn(s, OUT, generator=g, dtype=dtype))
        for s in (8, 5, 8, 7)
    ]
    big = OOMAbove(dtype, seed, limit=100)
    small = OOMAbove(dtype, seed, limit=3, where=where)
    config = GradientAccumulationConfig(accumulation_steps=n, max_grad_norm=0.3)
    plain = GradientAccumulator(big, torch.optim.AdamW(big.parameters(), lr=0.05), config)
    adaptive = AdaptiveGradientAccumulator(small, torch.optim.AdamW(small.parameters(), lr=0.05), config)
    assert run(plain, batches) == run(adaptive, batches)
    assert_params_close(small, big, dtype)
    assert adaptive.micro_batch_size == 2  # 8 -> 4 -> 2, and kept
    history = adaptive.get_adaptation_stats()["adaptation_history"]
    assert [(h["from"], h["to"]) for h in history] == [(8, 4), (4, 2)]
    assert small.ooms == 2  # later batches start at the learned size: no further OOMs
    assert adaptive.stats.micro_steps == 4 and adaptive.optimizer_steps == 2


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_oom_split_keeps_token_weighting(mode):
    dtype, seed, n = torch.float64, 7, 3
    batches = padded_batches(6, seed, dtype)
    model_a, model_b = OOMAbove(dtype, seed, 100), OOMAbove(dtype, seed, 1)

    def loss_fn(model, batch):
        tokens = batch[2].sum()
        total = token_sum(model, batch)  # the model's OOM limit counts sequences (dim 0)
        return (total if mode == "sum" else total / tokens), tokens.to(torch.int64)

    config = GradientAccumulationConfig(accumulation_steps=n, loss_normalization=mode)
    plain = GradientAccumulator(model_a, torch.optim.SGD(model_a.parameters(), lr=0.2), config)
    adaptive = AdaptiveGradientAccumulator(model_b, torch.optim.SGD(model_b.parameters(), lr=0.2), config)
    run(plain, batches, loss_fn)
    run(adaptive, batches, loss_fn)
    assert_params_close(model_b, model_a, dtype)
    assert adaptive.micro_batch_size == 1


def test_floor_raises_clearly_and_leaves_window_usable():
    dtype, seed = torch.float64, 11
    model = OOMAbove(dtype, seed, limit=2)
    acc = AdaptiveGradientAccumulator(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        GradientAccumulationConfig(accumulation_steps=2),
        min_micro_batch_size=4,
    )
    batch = make_batches(1, 8, dtype, seed)[0]
    with pytest.raises(RuntimeError, match="out of memory at micro-batch size 4, which is the floor") as info:
        acc.step_batch(batch, mean_loss)
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert all(p.grad is None for p in model.parameters()) and acc.micro_steps_in_window == 0


def test_bad_sizes_and_batches():
    model = OOMAbove(torch.float32, 1, 100)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = GradientAccumulationConfig(accumulation_steps=2)
    with pytest.raises(ValueError, match="min_micro_batch_size must be an integer >= 1"):
        AdaptiveGradientAccumulator(model, opt, config, min_micro_batch_size=0)
    with pytest.raises(ValueError, match="micro_batch_size must be an integer >= 1"):
        AdaptiveGradientAccumulator(model, opt, config, micro_batch_size=2.5)
    acc = AdaptiveGradientAccumulator(model, opt, config, micro_batch_size=3)
    with pytest.raises(ValueError, match="share their first dimension"):
        acc.step_batch((torch.randn(4, IN), torch.randn(5, OUT)), mean_loss)
    chunks = split_batch({"x": torch.arange(7), "meta": "keep", "pair": (torch.arange(7), torch.arange(7) * 2)}, 3)
    assert [c["x"].tolist() for c in chunks] == [[0, 1, 2], [3, 4, 5], [6]]
    assert all(c["meta"] == "keep" and torch.equal(c["pair"][1], 2 * c["x"]) for c in chunks)


def test_initial_micro_batch_size_splits_without_oom():
    dtype, seed = torch.float64, 13
    batches = make_batches(4, 6, dtype, seed)
    a, b = OOMAbove(dtype, seed, 100), OOMAbove(dtype, seed, 100)
    config = GradientAccumulationConfig(accumulation_steps=2)
    run(GradientAccumulator(a, torch.optim.SGD(a.parameters(), lr=0.3), config), batches)
    acc = AdaptiveGradientAccumulator(b, torch.optim.SGD(b.parameters(), lr=0.3), config, micro_batch_size=4)
    run(acc, batches)
    assert_params_close(b, a, dtype)
    assert acc.get_adaptation_stats()["oom_splits"] == 0 and TOL[dtype]
