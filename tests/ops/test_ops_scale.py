"""unscale_, clip_by_norm_, clip_by_value_ and clip_grad_norm_ against the float64 oracle."""

from __future__ import annotations

import math

import pytest
import torch
from _oracle import (
    DTYPES,
    LOW,
    ODD_SIZES,
    U32,
    assert_bits_unchanged,
    assert_bitwise_equal,
    assert_close_list,
    assert_norm_close,
    f64,
    name,
    norm_rtol,
    rand_list,
    random_dtypes,
    small_sizes,
    snapshot,
)

import gradacc_ext
from gradacc_ext.ops import DEFAULT_EPS

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # the kernels' threading: see the determinism tests

KINDS = [*(name(d) for d in DTYPES), "mixed"]
LAYOUTS = ["odd", "many", "unaligned", "empties"]


def make_tensors(kind: str, layout: str, device: str, gen: torch.Generator, std: float = 1.0) -> list[torch.Tensor]:
    sizes = {
        "odd": list(ODD_SIZES),
        "unaligned": list(ODD_SIZES),
        "many": small_sizes(gen) if layout == "many" else [],
        "empties": [0, 65537, 0, 7, 0],
    }[layout]
    dtypes = random_dtypes(gen, len(sizes)) if kind == "mixed" else getattr(torch, kind)
    return rand_list(sizes, dtypes, device, gen, unaligned=layout == "unaligned", std=std)


def random_f32(gen: torch.Generator, low: float, high: float) -> float:
    """A fresh value that fp32 represents exactly (so no double rounding on the way to 16 bits)."""
    return float(torch.empty((), dtype=torch.float32).uniform_(low, high, generator=gen))


def all_bit_patterns(dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).to(device)


# ---- unscale_ ---------------------------------------------------------------------------------


@pytest.mark.parametrize("found_start", [0.0, 1.0], ids=["f0", "f1"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_unscale_matches_oracle(device, backend, gen, kind, layout, found_start):
    tensors = make_tensors(kind, layout, device, gen, std=1000.0)
    inv = torch.full((), random_f32(gen, 1e-4, 1e-2), device=device)
    x64 = f64(tensors)
    want = [x * inv.item() for x in x64]
    found = torch.full((1,), found_start, device=device)
    gradacc_ext.unscale_(tensors, inv, found, backend=backend)
    assert_close_list(tensors, want, [w.abs() for w in want], roundings=1, what="tensors")
    assert found.item() == found_start  # all finite: never set, never cleared


@pytest.mark.parametrize("where", ["first", "middle", "last", "body"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", DTYPES, ids=name)
def test_unscale_flags_nonfinite_inputs(device, backend, gen, dtype, value, where):
    """first/middle/last sit in the CPU kernels' scalar tails; body (element 100) in their vector loop."""
    tensors = rand_list([7, 65537, 1000], dtype, device, gen)
    tensor, elem = {"first": (0, 0), "middle": (1, 65536), "last": (2, 999), "body": (1, 100)}[where]
    tensors[tensor][elem] = value
    inv = torch.full((), 0.5, device=device)
    want = [x * 0.5 for x in f64(tensors)]
    found = torch.zeros(1, device=device)
    gradacc_ext.unscale_(tensors, inv, found, backend=backend)
    assert found.item() == 1.0
    assert_close_list(tensors, want, [w.abs() for w in want], roundings=1, what="tensors")


def test_unscale_empty_list(device, backend):
    found = torch.zeros(1, device=device)
    gradacc_ext.unscale_([], torch.ones((), device=device), found, backend=backend)
    assert found.item() == 0.0


# ---- clip_by_norm_ ----------------------------------------------------------------------------


def clip_oracle(tensors: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float, eps: float):
    """(want, magnitude): x * min(1, max_norm / (norm + eps)) in float64, from the fp32 norm given."""
    coef = min(1.0, max_norm / (total_norm.item() + eps))
    want = [x * coef for x in f64(tensors)]
    return want, [w.abs() for w in want]


# coefficient: fp32 max_norm and eps (2), the add, the divide (torch backend: reciprocal then multiply),
# then the multiply of each element
CLIP_ROUNDINGS = 6


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_clip_by_norm_clips(device, backend, gen, kind, layout):
    tensors = make_tensors(kind, layout, device, gen)
    total = gradacc_ext.global_norm(tensors, backend=backend)
    max_norm = random_f32(gen, 0.05, 0.9) * total.item()  # coefficient < 1
    want, mags = clip_oracle(tensors, total, max_norm, DEFAULT_EPS)
    gradacc_ext.clip_by_norm_(tensors, total, max_norm, backend=backend)
    assert_close_list(tensors, want, mags, roundings=CLIP_ROUNDINGS, what="tensors")


@pytest.mark.parametrize("kind", KINDS)
def test_clip_by_norm_is_a_bitwise_noop_below_max_norm(device, backend, gen, kind):
    tensors = make_tensors(kind, "odd", device, gen)
    total = gradacc_ext.global_norm(tensors, backend=backend)
    before = snapshot(tensors)
    gradacc_ext.clip_by_norm_(tensors, total, total.item() * random_f32(gen, 1.01, 10.0), backend=backend)
    assert_bits_unchanged(before, tensors, "tensors")
    gradacc_ext.clip_by_norm_(tensors, torch.zeros((), device=device), 1e-3, backend=backend)  # norm 0
    assert_bits_unchanged(before, tensors, "tensors")


@pytest.mark.parametrize("norm", [math.nan, math.inf], ids=["nan", "inf"])
def test_clip_by_norm_nonfinite_norm(device, backend, gen, norm):
    """Like torch's clip_grad_norm_: a NaN norm makes everything NaN, an Inf norm scales to zero."""
    tensors = rand_list([7, 65537], [torch.float32, torch.bfloat16], device, gen)
    gradacc_ext.clip_by_norm_(tensors, torch.full((), norm, device=device), 1.0, backend=backend)
    for t in tensors:
        assert t.isnan().all() if math.isnan(norm) else (t == 0).all(), t


# ---- clip_by_value_ ---------------------------------------------------------------------------


def clamp_oracle(tensors: list[torch.Tensor], clip_value: float) -> list[torch.Tensor]:
    """Exact: clamp in float64, then the store rounds the bound itself to the tensor's dtype."""
    return [x.double().clamp(-clip_value, clip_value).to(x.dtype) for x in tensors]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_clip_by_value_matches_oracle(device, backend, gen, kind, layout):
    tensors = make_tensors(kind, layout, device, gen)
    for t in tensors[1:2]:
        t[:3] = torch.tensor([math.nan, math.inf, -math.inf])[: t.numel()]  # NaN stays, Inf clamps
    clip_value = random_f32(gen, 0.2, 1.5)
    want = clamp_oracle(tensors, clip_value)
    gradacc_ext.clip_by_value_(tensors, clip_value, backend=backend)
    for i, (t, w) in enumerate(zip(tensors, want, strict=True)):
        assert_bitwise_equal(t, w, what=f"tensors[{i}]")
    assert any((t.abs() == torch.tensor(clip_value).to(t.dtype)).any() for t in tensors), "nothing was clipped"


def test_clip_by_value_empty_list(device, backend):
    gradacc_ext.clip_by_value_([], 1.0, backend=backend)


# ---- every 16-bit value through the scale kernels -------------------------------------------


@pytest.mark.parametrize("op", ["unscale_", "clip_by_norm_", "clip_by_value_"])
@pytest.mark.parametrize("dtype", LOW, ids=name)
def test_16bit_scale_ops_match_torch_for_every_bit_pattern(device, backend, gen, dtype, op):
    """All 65,536 fp16/bf16 values: load, fp32 op, round-to-nearest-even store (subnormals, overflow to
    Inf, NaN) give exactly what torch's fp32 math followed by .to(dtype) gives."""
    x = all_bit_patterns(dtype, device)
    f = x.float()
    if op == "unscale_":
        # a factor > 1 (an fp32 value, not a power of two) overflows the top and rounds everywhere
        inv = torch.full((), random_f32(gen, 1.001, 3.0), device=device)
        want = torch.mul(f, inv).to(dtype)
        found = torch.zeros(1, device=device)
        gradacc_ext.unscale_([x], inv, found, backend=backend)
        assert found.item() == 1.0  # the patterns include NaN and Inf
    elif op == "clip_by_norm_":
        norm, max_norm = torch.full((), random_f32(gen, 2.0, 50.0), device=device), random_f32(gen, 0.1, 1.0)
        if backend == "ext":  # the kernels divide once; the torch backend takes a reciprocal, then multiplies
            coef = torch.div(torch.tensor(max_norm, device=device), norm + DEFAULT_EPS)
        else:
            coef = max_norm / (norm + DEFAULT_EPS)
        want = torch.mul(f, coef).to(dtype)
        gradacc_ext.clip_by_norm_([x], norm, max_norm, backend=backend)
    else:
        clip_value = random_f32(gen, 0.01, 100.0)
        want = f.clamp(-clip_value, clip_value).to(dtype)
        gradacc_ext.clip_by_value_([x], clip_value, backend=backend)
    assert_bitwise_equal(x, want, what=f"{op} on {name(dtype)}")


# ---- clip_grad_norm_ --------------------------------------------------------------------------


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "linf"])
@pytest.mark.parametrize("kind", KINDS)
def test_clip_grad_norm_matches_torch(device, backend, gen, kind, norm_type):
    """Returns the pre-clip norm and clips like torch.nn.utils.clip_grad_norm_ run in float64."""
    tensors = make_tensors(kind, "odd", device, gen)
    x64 = f64(tensors)
    max_norm = random_f32(gen, 0.1, 5.0)
    params = [torch.zeros_like(x).requires_grad_() for x in x64]
    for p, x in zip(params, x64, strict=True):
        p.grad = x.clone()
    torch_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    got_norm = gradacc_ext.clip_grad_norm_(tensors, max_norm, norm_type, backend=backend)
    assert_norm_close(got_norm, x64, norm_type, what="returned norm")
    assert math.isclose(torch_norm.item(), float(got_norm), rel_tol=1e-5)
    want = [p.grad for p in params]
    # the coefficient also carries the fp32 norm's own error (norm_rtol, in units of 2^-24)
    extra = 0 if norm_type == math.inf else math.ceil(norm_rtol(ODD_SIZES) / U32)
    assert_close_list(tensors, want, [w.abs() for w in want], roundings=CLIP_ROUNDINGS + extra, what="clipped")


def test_clip_grad_norm_below_max_norm_is_a_bitwise_noop(device, backend, gen):
    tensors = make_tensors("mixed", "odd", device, gen)
    before = snapshot(tensors)
    total = gradacc_ext.clip_grad_norm_(tensors, 1e6, backend=backend)
    assert_bits_unchanged(before, tensors, "tensors")
    assert_norm_close(total, tensors, 2.0)
