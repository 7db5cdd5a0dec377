"""What the Linear fusion reports (accumulate/linear_fusion.py, loss_checks.py) is true.

- stats.fused_linear_params counts a weight shared by two fused Linears once;
- stats.linear_fusion_fallbacks lists a parameter only when no Linear fuses it (a weight tied to a fused
  Linear is fused, whatever its other module is), and one parameter once; the windows still equal the plain
  full-batch loop;
- the migration check "forward ran without autocast" sees the fused node's bf16 inputs: silent under the
  user's own autocast, a warning without it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from test_linear_fusion import FUSION, assert_params_close
from torch import nn

from gradacc_ext import GradientAccumulator
from gradacc_ext.accumulate.config import GradientAccumulationConfig

D = 6


class ScaledLinear(nn.Linear):
    """A Linear subclass with its own forward: the fusion leaves it to the hooks path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * super().forward(x)


class SharedWeight(nn.Module):
    """Two Linears with one weight (their own biases); `kinds` picks each one's class, in registration order."""

    def __init__(self, kinds: tuple[type[nn.Linear], type[nn.Linear]]) -> None:
        super().__init__()
        self.a, self.b = kinds[0](D, D), kinds[1](D, D)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def build(kinds: tuple[type[nn.Linear], type[nn.Linear]], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return SharedWeight(kinds).double()


# kinds -> (fused_linear_params, fallback names)
CASES = {
    "both_fused": ((nn.Linear, nn.Linear), 3, set()),
    "fused_then_refused": ((nn.Linear, ScaledLinear), 2, {"b.bias"}),
    "refused_then_fused": ((ScaledLinear, nn.Linear), 2, {"a.bias"}),
    "both_refused": ((ScaledLinear, ScaledLinear), 0, {"a.weight", "a.bias", "b.bias"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_shared_weight_is_counted_once_and_listed_only_when_unfused(case):
    kinds, fused, fallbacks = CASES[case]
    n, seed = 2, 61
    g = torch.Generator().manual_seed(seed)
    batches = [tuple(torch.randn(3, 4, D, generator=g, dtype=torch.float64) for _ in "xy") for _ in range(4)]
    model, ref = build(kinds, seed), build(kinds, seed)
    cfg = GradientAccumulationConfig(accumulation_steps=n, max_grad_norm=0.3, **FUSION)
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), cfg)
    assert acc.stats.fused_linear_params == fused
    assert set(acc.stats.linear_fusion_fallbacks) == fallbacks
    assert all("has its own forward" in why for why in acc.stats.linear_fusion_fallbacks.values())
    for x, y in batches:
        with acc.micro_step():
            acc.backward(F.mse_loss(model(x), y))
    opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    for start in range(0, len(batches), n):
        opt.zero_grad()
        (sum(F.mse_loss(ref(x), y) for x, y in batches[start : start + n]) / n).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)  # the shared weight counted once
        opt.step()
    assert_params_close(model, ref, torch.float64)
    acc.close()


def bf16_accumulator(seed: int) -> tuple[nn.Module, GradientAccumulator]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    cfg = GradientAccumulationConfig(accumulation_steps=2, mixed_precision="bf16", **FUSION)
    return model, GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)


def test_fused_forward_under_users_autocast_outside_micro_step_does_not_warn():
    model, acc = bf16_accumulator(seed=67)
    x, y = torch.randn(4, 5), torch.randn(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            loss = F.mse_loss(out, y)
        assert out.dtype == torch.bfloat16 and acc.stats.fused_linear_params == 4
        acc.backward(loss)
    acc.close()


def test_fused_forward_without_autocast_outside_micro_step_still_warns():
    model, acc = bf16_accumulator(seed=71)
    x, y = torch.randn(4, 5), torch.randn(4, 3)
    with pytest.warns(UserWarning, match="forward ran without autocast"):
        acc.backward(F.mse_loss(model(x), y))
    acc.close()
