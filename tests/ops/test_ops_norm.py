"""global_norm (L2 and inf, total and per tensor) against the float64 oracle, on both backends."""

from __future__ import annotations

import math

import pytest
import torch
from _oracle import (
    DTYPES,
    ODD_SIZES,
    assert_bitwise_equal,
    assert_norm_close,
    assert_per_tensor_norms,
    cpu_threads,
    name,
    rand,
    rand_list,
    random_dtypes,
    small_sizes,
)

import gradacc_ext

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests that need threads ask for them

NORM_TYPES = [pytest.param(2.0, id="l2"), pytest.param(math.inf, id="linf")]
KINDS = [*(name(d) for d in DTYPES), "mixed"]


def make_tensors(kind: str, layout: str, device: str, gen: torch.Generator) -> list[torch.Tensor]:
    shapes: list[tuple[int, ...]]
    if layout in ("odd", "unaligned"):
        shapes = [(n,) for n in ODD_SIZES]
    elif layout == "single":
        shapes = [(1,)]
    elif layout == "many":
        shapes = [(n,) for n in small_sizes(gen)]
    elif layout == "shapes":
        shapes = [(3, 5, 7), (2, 65537), (1, 1)]
    else:
        assert layout == "empties"
        shapes = [(0,), (65537,), (0, 4), (7,), (0,)]
    dtypes = random_dtypes(gen, len(shapes)) if kind == "mixed" else [getattr(torch, kind)] * len(shapes)
    return [rand(s, d, device, gen, unaligned=layout == "unaligned") for s, d in zip(shapes, dtypes, strict=True)]


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("layout", ["odd", "single", "many", "shapes", "unaligned", "empties"])
@pytest.mark.parametrize("kind", KINDS)
def test_global_norm_matches_oracle(device, backend, gen, kind, layout, norm_type):
    tensors = make_tensors(kind, layout, device, gen)
    total, each = gradacc_ext.global_norm(tensors, norm_type, per_tensor=True, backend=backend)
    assert total.shape == () and total.device == tensors[0].device
    assert_norm_close(total, tensors, norm_type, what="total")
    assert_per_tensor_norms(each, tensors, norm_type)

    again = gradacc_ext.global_norm(tensors, norm_type, backend=backend)  # per_tensor=False: the total alone
    assert isinstance(again, torch.Tensor)
    assert_bitwise_equal(again, total, what="total without per_tensor")


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=name)
def test_global_norm_large_tensor(device, backend, gen, dtype, norm_type):
    tensors = [rand(3_000_017, dtype, device, gen)]
    assert_norm_close(gradacc_ext.global_norm(tensors, norm_type, backend=backend), tensors, norm_type)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_mixed_dtype_list_reads_each_tensor_as_its_own_dtype(device, backend, gen, norm_type):
    """Megatron #7338: one launch over a bf16/fp32/fp16 list must read every tensor with its own dtype.
    The magnitudes differ by dtype, so a tensor read as the wrong type changes the norm grossly."""
    dtypes = [torch.bfloat16, torch.float32, torch.float16] * 5
    stds = {torch.float32: 30.0, torch.bfloat16: 1e-2, torch.float16: 3.0}
    sizes = [7, 65537, 1000] * 5
    tensors = [rand(n, d, device, gen, std=stds[d]) for n, d in zip(sizes, dtypes, strict=True)]
    total, each = gradacc_ext.global_norm(tensors, norm_type, per_tensor=True, backend=backend)
    assert_norm_close(total, tensors, norm_type)
    assert_per_tensor_norms(each, tensors, norm_type)


# (value, where): a NaN or an Inf in the first, a middle or the last tensor, at its first/middle/last element
NONFINITE_AT = {"first": (0, 0), "middle": (1, 40000), "last": (2, 999)}


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("where", list(NONFINITE_AT))
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", DTYPES, ids=name)
def test_global_norm_nonfinite(device, backend, gen, dtype, value, where, norm_type):
    tensors = rand_list([7, 65537, 1000], dtype, device, gen)
    tensor, elem = NONFINITE_AT[where]
    tensors[tensor][elem] = value
    total, each = gradacc_ext.global_norm(tensors, norm_type, per_tensor=True, backend=backend)
    if math.isnan(value):
        assert total.isnan() and each[tensor].isnan()
    else:
        assert total.item() == math.inf and each[tensor].item() == math.inf
    # the other tensors' norms are untouched by it
    assert_per_tensor_norms(each, tensors, norm_type)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_global_norm_nan_beats_inf(device, backend, gen, norm_type):
    """NaN and Inf in one list: the norm is NaN (Inf must not hide the NaN, whichever comes first)."""
    for nan_first in (True, False):
        tensors = rand_list([65537, 70000], [torch.float32, torch.bfloat16], device, gen)
        tensors[0 if nan_first else 1][5] = math.nan
        tensors[1 if nan_first else 0][-1] = math.inf
        assert gradacc_ext.global_norm(tensors, norm_type, backend=backend).isnan()


def test_global_norm_of_empty_lists_and_tensors(device, backend, gen):
    total, each = gradacc_ext.global_norm([], per_tensor=True, backend=backend)
    assert total.dtype == torch.float32 and total.shape == () and total.item() == 0.0
    assert each.dtype == torch.float32 and each.shape == (0,)

    empties = [torch.empty(0, device=device), torch.empty(0, 3, dtype=torch.bfloat16, device=device)]
    for norm_type in (2.0, math.inf):
        total, each = gradacc_ext.global_norm(empties, norm_type, per_tensor=True, backend=backend)
        assert total.item() == 0.0 and torch.equal(each.cpu(), torch.zeros(2))


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_global_norm_is_deterministic(device, backend, gen, norm_type):
    """Bitwise-equal over three runs of a large list; the kernels also over CPU thread counts."""
    sizes = [*ODD_SIZES, 2_000_003, *small_sizes(gen, count=300)]
    tensors = rand_list(sizes, random_dtypes(gen, len(sizes)), device, gen)
    with cpu_threads(2):
        runs = [gradacc_ext.global_norm(tensors, norm_type, per_tensor=True, backend=backend) for _ in range(3)]
    if backend == "ext":
        with cpu_threads(1):
            runs.append(gradacc_ext.global_norm(tensors, norm_type, per_tensor=True, backend=backend))
    for total, each in runs[1:]:
        assert_bitwise_equal(total, runs[0][0], what="total")
        assert_bitwise_equal(each, runs[0][1], what="per-tensor")
    assert_norm_close(runs[0][0], tensors, norm_type)
