"""quant_math.cuh's bucket encoder (bucket table, then kQuantEncodeSteps comparisons against the midpoints padded
with +inf), emulated here step for step on quant_maps.encode_buckets' tables, gives exactly the binary search's
code (the number of midpoints strictly below y, NaN -> 0) at every value where it could go wrong."""

from __future__ import annotations

import pytest
import torch

from gradacc_ext.ops import quant_maps as qm


def _bucket_encode(y: torch.Tensor, signed: bool) -> torch.Tensor:
    """quant_encode's arithmetic, on int64 bits (the C++ works on uint32)."""
    first, steps = qm.encode_buckets(signed)
    mids = torch.cat([qm.midpoints(signed), torch.tensor([float("inf")])])
    bits = y.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    mag = (bits & 0x7FFFFFFF).clamp(qm.ENCODE_LOW_BITS, qm.ENCODE_HIGH_BITS)
    c = first[(bits >> 31) * qm.ENCODE_BUCKETS + ((mag - qm.ENCODE_LOW_BITS) >> qm.ENCODE_SHIFT)].to(torch.int64)
    for _ in range(steps):
        c = c + (mids[c] < y).to(torch.int64)
    return torch.where(y.isnan(), 0, c)


def _floats(bits: torch.Tensor) -> torch.Tensor:
    return (bits & 0xFFFFFFFF).to(torch.int64).to(torch.int32).view(torch.float32)  # wraps like uint32 -> int32


def _neighbours(x: torch.Tensor) -> torch.Tensor:
    """x and its float32 neighbours, both ways."""
    inf = torch.full_like(x, float("inf"))
    return torch.cat([x, torch.nextafter(x, inf), torch.nextafter(x, -inf)])


def _edge_values() -> torch.Tensor:
    b = torch.arange(qm.ENCODE_BUCKETS + 1, dtype=torch.int64)
    edges = _floats(qm.ENCODE_LOW_BITS + (b << qm.ENCODE_SHIFT))  # each bucket's first magnitude, and the one past
    clamp_ends = _floats(torch.tensor([qm.ENCODE_LOW_BITS, qm.ENCODE_HIGH_BITS]))
    tiny = torch.tensor([0.0, 1.0, 2.0**-149, 2.0**-126, 1e-30, 1e-10, 2.0**-24, 2.0, 1e30, float("inf")])
    magnitudes = _neighbours(torch.cat([edges, clamp_ends, tiny]))
    return torch.cat([magnitudes, -magnitudes])


@pytest.mark.parametrize("signed", [True, False])
def test_steps_bound_is_small(signed):
    _, steps = qm.encode_buckets(signed)
    assert 1 <= steps <= 2  # the C++ loop runs max(steps of both maps): kQuantEncodeSteps


@pytest.mark.parametrize("signed", [True, False])
def test_bucket_encode_equals_search_at_midpoints_and_edges(signed):
    y = torch.cat([_neighbours(qm.midpoints(signed)), _neighbours(qm.code_values(signed)), _edge_values()])
    assert torch.equal(_bucket_encode(y, signed), qm.encode(y, signed))


@pytest.mark.parametrize("signed", [True, False])
def test_bucket_encode_equals_search_on_nans_zeros_and_random(signed):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    random_bits = _floats(torch.randint(0, 2**32, (1 << 20,), generator=g, dtype=torch.int64))
    uniform = torch.rand(1 << 20, generator=g) * 2 - 1
    nans = _floats(torch.tensor([0x7FC00000, 0x7F800001, 0xFFC00000, 0xFFFFFFFF]))
    y = torch.cat([random_bits, uniform, nans, torch.tensor([0.0, -0.0, 1.0, -1.0])])
    got, want = _bucket_encode(y, signed), qm.encode(y, signed)
    assert torch.equal(got, want)
    assert bool((got[-8:-4] == 0).all())  # NaN -> code 0
