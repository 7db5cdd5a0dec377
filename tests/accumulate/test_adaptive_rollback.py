"""AdaptiveGradientAccumulator with an OOM in ANY chunk's forward or backward: the step equals the full batch.

Issue 27, finding 3: an OOM in a later chunk's backward, after earlier chunks had been added into the window's
sums, discarded the whole window (a RuntimeWarning) and then closed it with what was left (max |param - full
batch| = 0.46). The reference is one float64 SGD step on the window's whole batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _cases import OOMInBackward, assert_params_close, make_batches

from gradacc_ext.accumulate.adaptive import AdaptiveGradientAccumulator
from gradacc_ext.accumulate.config import GradientAccumulationConfig

F64 = torch.float64
IN, HIDDEN, OUT = 5, 7, 3


class OOMOnCall(torch.nn.Module):
    """Passes its input through; its `nth` call raises torch.OutOfMemoryError once, in forward or in backward."""

    def __init__(self, nth: int, where: str) -> None:
        super().__init__()
        self.nth, self.where, self.calls, self.ooms = nth, where, 0, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls != self.nth:
            return x
        if self.where == "forward":
            self.ooms += 1
            raise torch.OutOfMemoryError(f"injected in forward call {self.nth}")
        return OOMInBackward.apply(x, self)


def make_model(seed: int, oom: torch.nn.Module) -> torch.nn.Sequential:
    # The OOM sits between the layers: in backward the last Linear (and its bias) is already folded (or written
    # by the fusion) when it fires, the first is not.
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), oom, torch.nn.Linear(HIDDEN, OUT)).to(F64)


def mean_loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def full_batch_step(model: torch.nn.Module, batches, lr: float) -> None:
    """One float64 SGD step on the mean of the micro-batches' mean losses (equal sizes: the full batch's mean)."""
    loss = sum(mean_loss(model, b) for b in batches) / len(batches)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad


STEPS, SIZE, LR = 3, 4, 0.5


@pytest.mark.parametrize("fusion", [False, True], ids=["hooks", "fusion"])
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("nth", [1, 2, 4, 5, 6])  # chunks of 2: calls 1-2 are batch 1, 3-4 batch 2, 5-6 batch 3
def test_oom_in_any_chunk_equals_the_full_batch(nth, where, fusion):
    seed = 100 + nth
    batches = make_batches(STEPS, SIZE, F64, seed)
    oom = OOMOnCall(nth, where)
    model, ref = make_model(seed, oom), make_model(seed, torch.nn.Identity())
    config = GradientAccumulationConfig(accumulation_steps=STEPS, gradient_accumulation_fusion=fusion)
    with AdaptiveGradientAccumulator(
        model, torch.optim.SGD(model.parameters(), lr=LR), config, micro_batch_size=2
    ) as acc:
        closed = [acc.step_batch(b, mean_loss) for b in batches]
    full_batch_step(ref, batches, LR)
    assert closed == [False, False, True] and oom.ooms == 1
    assert_params_close(model, ref, F64)
    assert acc.micro_batch_size == 1 and acc.stats.micro_steps == STEPS and acc.optimizer_steps == 1
    history = acc.get_adaptation_stats()["adaptation_history"]
    assert [(h["from"], h["to"]) for h in history] == [(2, 1)]


@pytest.mark.parametrize("grad_views", [False, True], ids=["buffers", "grad_views"])
def test_oom_in_a_later_unsplit_backward_equals_the_full_batch(grad_views):
    """Unsplit micro-batches have weight 1: with grad_views autograd adds into the views in place."""
    seed = 131
    batches = make_batches(STEPS, SIZE, F64, seed)
    oom = OOMOnCall(3, "backward")  # the third micro-batch, whole
    model, ref = make_model(seed, oom), make_model(seed, torch.nn.Identity())
    config = GradientAccumulationConfig(accumulation_steps=STEPS, grad_views=grad_views)
    with AdaptiveGradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=LR), config) as acc:
        for b in batches:
            acc.step_batch(b, mean_loss)
    full_batch_step(ref, batches, LR)
    assert oom.ooms == 1 and acc.micro_batch_size == 2 and acc.optimizer_steps == 1
    assert_params_close(model, ref, F64)


def test_a_batch_changed_in_place_is_not_replayed():
    """Replaying the window needs its earlier batches as they were: one written in place since is refused."""
    seed = 137
    batches = make_batches(STEPS, SIZE, F64, seed)
    model = make_model(seed, OOMOnCall(4, "backward"))
    config = GradientAccumulationConfig(accumulation_steps=STEPS)
    acc = AdaptiveGradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=LR), config, micro_batch_size=2)
    acc.step_batch(batches[0], mean_loss)
    batches[0][0].mul_(2.0)  # e.g. a loader that reuses its batch tensors
    with pytest.raises(RuntimeError, match="changed in place") as info:
        acc.step_batch(batches[1], mean_loss)
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert acc.micro_steps_in_window == 0 and all(p.grad is None for p in model.parameters())
