"""Checks that two implementations computed the same thing, before either is timed.

The error of a group of tensors (all buffers, the returned norm, ...) is the
largest elementwise |actual - expected| divided by the largest |expected| of
the group. Equal values (infinities included) and NaN against NaN count as
exact; any other NaN or infinity is an infinite error. Work is done in slices
so that a tensor of more than 2**31 elements needs no full-size temporaries.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

RTOL = 1e-4  # reduction order differs between implementations; a wrong op is off by orders more
_SLICE = 1 << 24


def _chunks(expected: Sequence[torch.Tensor], actual: Sequence[torch.Tensor]):
    """(expected, actual) float64 pairs of at most _SLICE elements: large tensors in slices, small ones
    concatenated (comparing 2,000 small tensors one by one is slower than the benchmark itself)."""
    if sum(e.numel() for e in expected) <= _SLICE:  # the common case: one pair, no slicing
        yield (torch.cat([e.detach().reshape(-1) for e in expected]).double(),
               torch.cat([a.detach().reshape(-1) for a in actual]).double())  # fmt: skip
        return
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    size = 0
    for e, a in zip(expected, actual, strict=True):
        fe, fa = e.detach().reshape(-1), a.detach().reshape(-1)
        for start in range(0, fe.numel(), _SLICE):
            pending.append((fe[start : start + _SLICE], fa[start : start + _SLICE]))
            size += pending[-1][0].numel()
            if size >= _SLICE:
                yield torch.cat([x for x, _ in pending]).double(), torch.cat([y for _, y in pending]).double()
                pending, size = [], 0
    if pending:
        yield torch.cat([x for x, _ in pending]).double(), torch.cat([y for _, y in pending]).double()


def group_error(expected: Sequence[torch.Tensor], actual: Sequence[torch.Tensor]) -> float:
    if len(expected) != len(actual) or any(e.shape != a.shape for e, a in zip(expected, actual, strict=True)):
        return math.inf
    worst_diff, scale = 0.0, 0.0
    for es, as_ in _chunks(expected, actual):
        same = (es == as_) | (es.isnan() & as_.isnan())
        diff = torch.where(same, torch.zeros_like(es), (as_ - es).abs().nan_to_num(nan=math.inf))
        worst_diff = max(worst_diff, float(diff.max()))
        finite = es[es.isfinite()]
        if finite.numel():
            scale = max(scale, float(finite.abs().max()))
    if worst_diff == 0.0:
        return 0.0
    return worst_diff / scale if scale > 0 else math.inf


def output_error(expected: dict[str, list[torch.Tensor]], actual: dict[str, list[torch.Tensor]]) -> float:
    """The worst group error; infinite if the two produced different kinds of output."""
    if expected.keys() != actual.keys():
        return math.inf
    return max(group_error(expected[k], actual[k]) for k in expected)
