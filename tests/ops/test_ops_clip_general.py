"""The norm and clip ops beyond L2/inf and contiguous fp32 norms: any p, dense permuted tensors in place,
a total_norm of any float dtype or a Python number, max_norm 0/inf, clip values 0/inf/negative."""

from __future__ import annotations

import math

import pytest
import torch
from _oracle import U32, assert_bits_unchanged, f64, norm_rtol, random_dtypes, snapshot

import gradacc_ext
from gradacc_ext.ops import reference

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

P_VALUES = [0.0, 1.0, 0.5, 1.5, 3.0, 4.0, -math.inf, -1.0]


def mixed_tensors(device: str, gen: torch.Generator, *, channels_last: bool = False) -> list[torch.Tensor]:
    """Odd sizes, a multi-chunk tensor, an exact zero (p = 0 and -inf see it), fresh values, mixed dtypes."""
    shapes = [(7,), (65537,), (3, 5, 2, 4), (1,), (2, 3, 4, 5)]
    out = []
    for shape, dtype in zip(shapes, random_dtypes(gen, len(shapes)), strict=True):
        t = torch.randn(shape, generator=gen).to(dtype).to(device)
        if channels_last and t.dim() == 4:
            t = t.to(memory_format=torch.channels_last)
            assert not t.is_contiguous()
        out.append(t)
    out[2][0, 0, 0, 3] = 0.0
    out[0][2] = 0.0
    return out


def p_norm_rtol(tensors: list[torch.Tensor], p: float) -> float:
    """fp32 sums like the L2 bound, plus one rounding per pow; the final 1/p power scales the sum's
    relative error by 1/|p|. 0 and -inf are exact (a count, a min of exactly converted values)."""
    if p == 0.0 or math.isinf(p):
        return 0.0
    return max(1.0, 1.0 / abs(p)) * (norm_rtol([t.numel() for t in tensors]) + 4 * U32)


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("p", P_VALUES)
def test_p_norms_match_the_float64_oracle(device, backend, gen, p, channels_last):
    tensors = mixed_tensors(device, gen, channels_last=channels_last)
    total, each = gradacc_ext.global_norm(tensors, p, per_tensor=True, backend=backend)
    assert total.dtype == torch.float32 and each.shape == (len(tensors),)
    want_total, want_each = reference.global_norm(f64(tensors), p, True)
    rtol = p_norm_rtol(tensors, p)
    for got, want in ((total, want_total), (each, want_each)):
        torch.testing.assert_close(got.double().cpu(), want.cpu(), rtol=rtol, atol=0.0)


@pytest.mark.parametrize("p", [0.0, -math.inf, 3.0])
def test_p_norms_of_nonfinite_values(device, backend, gen, p):
    """NaN: every p-norm but 0 is NaN (NaN != 0 counts one, as torch counts it); Inf: -inf ignores it."""
    tensors = mixed_tensors(device, gen)
    tensors[1][100] = math.nan
    tensors[3][0] = math.inf
    got = gradacc_ext.global_norm(tensors, p, backend=backend)
    want = reference.global_norm(f64(tensors), p, False)[0]
    torch.testing.assert_close(got.double().cpu(), want.cpu(), rtol=p_norm_rtol(tensors, p), atol=0.0, equal_nan=True)


def test_dense_permuted_tensors_are_clipped_in_place(device, backend, gen):
    """channels_last and transposed grads: no copy (same storage, same strides), same values as contiguous."""
    shapes = [(4, 3, 5, 6), (6, 9)]
    tensors = [torch.randn(s, generator=gen).to(device) for s in shapes]
    tensors[0] = tensors[0].to(memory_format=torch.channels_last)
    tensors[1] = tensors[1].t()
    contiguous = [t.contiguous() for t in tensors]
    layout = [(t.data_ptr(), t.stride()) for t in tensors]

    norm = gradacc_ext.global_norm(tensors, backend=backend)  # storage order: rounds differently, same value
    want = gradacc_ext.global_norm(contiguous, backend=backend)
    torch.testing.assert_close(norm, want, rtol=norm_rtol([t.numel() for t in tensors]), atol=0.0)
    gradacc_ext.clip_by_norm_(tensors, norm, 0.5, backend=backend)
    gradacc_ext.clip_by_norm_(contiguous, norm, 0.5, backend=backend)
    gradacc_ext.clip_by_value_(tensors, 0.01, backend=backend)
    gradacc_ext.clip_by_value_(contiguous, 0.01, backend=backend)
    assert [(t.data_ptr(), t.stride()) for t in tensors] == layout
    for got, want in zip(tensors, contiguous, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("as_", ["float16", "bfloat16", "float64", "python"])
def test_total_norm_of_any_float_dtype_or_a_python_number(device, backend, gen, as_):
    """The coefficient is computed in fp32 from the norm's value: a 16-bit or fp64 norm (or a Python
    number) holding an fp32-exact value clips exactly like the float32 tensor of that value."""
    value = float((torch.rand((), generator=gen) * 10 + 1).to(torch.bfloat16))  # exact in every dtype
    tensors = mixed_tensors(device, gen)
    want = [t.clone() for t in tensors]
    gradacc_ext.clip_by_norm_(want, torch.tensor(value, device=device), 0.5, backend=backend)
    total = value if as_ == "python" else torch.tensor(value, dtype=getattr(torch, as_), device=device)
    gradacc_ext.clip_by_norm_(tensors, total, 0.5, backend=backend)
    for got, w in zip(tensors, want, strict=True):
        assert torch.equal(got, w)


def test_max_norm_inf_keeps_and_zero_zeroes(device, backend, gen):
    tensors = mixed_tensors(device, gen)
    norm = gradacc_ext.global_norm(tensors, backend=backend)
    before = snapshot(tensors)
    gradacc_ext.clip_by_norm_(tensors, norm, math.inf, backend=backend)
    assert_bits_unchanged(before, tensors, "max_norm=inf")
    returned = gradacc_ext.clip_grad_norm_(tensors, 0.0, backend=backend)
    assert torch.equal(returned, norm)
    assert all(torch.equal(t, torch.zeros_like(t)) for t in tensors)


@pytest.mark.parametrize("clip_value", [0.0, math.inf, -0.3, 0.7, 1e-30])
def test_clip_by_value_matches_torch_clamp(device, backend, gen, clip_value):
    """torch.clamp(min=-v, max=v): 0 zeroes, inf keeps, a negative v (empty range) gives v everywhere."""
    tensors = mixed_tensors(device, gen, channels_last=True)
    tensors[1][5] = math.nan
    want = [t.clone().clamp_(min=-clip_value, max=clip_value) for t in tensors]
    gradacc_ext.clip_by_value_(tensors, clip_value, backend=backend)
    for got, w in zip(tensors, want, strict=True):
        torch.testing.assert_close(got, w, rtol=0.0, atol=0.0, equal_nan=True)


F64_RTOL = 1e-12  # double sums of these sizes, and exp(p log|x|) for the p-norm terms


@pytest.mark.parametrize("p", [2.0, math.inf, 0.0, 1.0, 3.0, -math.inf])
def test_float64_lists_are_normed_in_double(device, backend, gen, p):
    """A list holding a float64 tensor accumulates in double (fp32/16-bit members widened exactly) and
    returns float64 norms; they match float64 torch.linalg.vector_norm to double rounding."""
    tensors = mixed_tensors(device, gen)
    tensors[1] = tensors[1].double() * 1e-3  # values fp32 cannot hold exactly
    tensors[1] += torch.randn(tensors[1].shape, generator=gen, dtype=torch.float64).to(device) * 1e-12
    total, each = gradacc_ext.global_norm(tensors, p, per_tensor=True, backend=backend)
    assert total.dtype == torch.float64 and each.dtype == torch.float64
    want_each = torch.stack([torch.linalg.vector_norm(t.double(), p) for t in tensors])
    want = reference.global_norm(f64(tensors), p, False)[0]
    torch.testing.assert_close(each.cpu(), want_each.cpu(), rtol=F64_RTOL, atol=0.0)
    torch.testing.assert_close(total.cpu(), want.cpu(), rtol=F64_RTOL, atol=0.0)


def test_float64_tensors_are_clipped_in_double(device, backend, gen):
    """clip_by_norm_ and clip_by_value_ on a float64 tensor: torch's float64 arithmetic, bit for bit
    (x * min(1, max_norm / (norm + eps)) and clamp); the fp32 neighbour keeps the fp32 coefficient."""
    x = torch.randn(1000, generator=gen, dtype=torch.float64).to(device)
    y = torch.randn(1000, generator=gen).to(device)
    norm = torch.linalg.vector_norm(x)
    want_x = x * torch.clamp(0.5 / (norm + 1e-6), max=1.0)
    want_y = y * torch.clamp(0.5 / (norm.float() + 1e-6), max=1.0)
    gradacc_ext.clip_by_norm_([x, y], norm, 0.5, backend=backend)
    assert torch.equal(x, want_x) and torch.equal(y, want_y)
    clip = 0.1 + 1e-12  # not a float32 value: a float32 clamp would round it
    want_x = x.clone().clamp_(-clip, clip)
    gradacc_ext.clip_by_value_([x], clip, backend=backend)
    assert torch.equal(x, want_x)
