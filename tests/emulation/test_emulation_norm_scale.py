"""Host emulation of the norm and clip kernels (csrc/kernels/norm.cuh, scale.cuh), float64 lists
included: evidence, not GPU verification (see tests/emulation/test_emulation.py, whose g++ build this shares).

A list holding float64 is normed in double with float64 outputs, and float64 tensors are clipped in
double (float64 total_norm used as is); the other members of the same launch stay in float32.
"""

from __future__ import annotations

import math

import pytest
import torch
from _emulation import HAS_CPU_KERNELS, MARKS, Emulator, assert_matches_cpu_kernels
from _oracle import (
    ODD_SIZES,
    assert_close_list,
    assert_norm_close,
    assert_per_tensor_norms,
    f64,
    oracle_norm,
    oracle_norms,
    rand_list,
    random_dtypes,
)

import gradacc_ext

pytestmark = MARKS

F32, F64 = torch.float32, torch.float64
LAYOUTS = ("odd", "unaligned")
F64_RTOL = 1e-12  # double sums of these sizes (tests/ops/test_ops_clip_general.py)


# ---- global_norm -----------------------------------------------------------------------------


def rand_tensors(numels, dtypes, gen, *, unaligned=False) -> list[torch.Tensor]:
    """rand_list, with float64 members off the float32 grid (a float kernel could not hold them)."""
    tensors = rand_list(numels, dtypes, "cpu", gen, unaligned=unaligned)
    for t in tensors:
        if t.dtype == F64:
            t.add_(torch.randn(t.shape, generator=gen, dtype=F64) * 2.0**-30)
    return tensors


def list_dtypes(kind: str, gen: torch.Generator, count: int) -> torch.dtype | list[torch.dtype]:
    """One dtype by name, "mixed" (fp32/fp16/bf16) or "mixed64" (the same with two float64 members)."""
    if not kind.startswith("mixed"):
        return getattr(torch, kind)
    dts = random_dtypes(gen, count)
    if kind == "mixed64":
        dts[1] = dts[4] = F64  # a one-chunk and a two-chunk tensor
    return dts


def assert_wide_norms(total, each, tensors, norm_type: float) -> None:
    """A list holding float64 sums in double: float64 outputs within double rounding of the oracle."""
    assert total.dtype == F64 and each.dtype == F64
    if norm_type in (2.0, math.inf):  # the oracle takes empty tensors (norm 0)
        want_each, want = oracle_norms(tensors, norm_type), oracle_norm(tensors, norm_type)
    else:
        x64 = f64(tensors)
        want_each = torch.stack([torch.linalg.vector_norm(x, norm_type) for x in x64])
        want = torch.linalg.vector_norm(torch.cat(x64), norm_type)
    rtol = 0.0 if norm_type in (0.0, math.inf, -math.inf) else F64_RTOL  # counts and extrema are exact
    torch.testing.assert_close(total, want, rtol=rtol, atol=0.0)
    torch.testing.assert_close(each, want_each, rtol=rtol, atol=0.0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
@pytest.mark.parametrize("dtypes", ["float32", "float16", "bfloat16", "float64", "mixed", "mixed64"])
def test_global_norm(emu, gen, dtypes, norm_type, layout):
    numels = [*ODD_SIZES, 0, 3]
    tensors = rand_tensors(numels, list_dtypes(dtypes, gen, len(numels)), gen, unaligned=layout == "unaligned")
    total, each = emu.global_norm(tensors, norm_type, per_tensor=True)
    if any(t.dtype == F64 for t in tensors):
        assert_wide_norms(total, each, tensors, norm_type)
        return
    assert_norm_close(total, tensors, norm_type, "total")
    assert_per_tensor_norms(each, tensors, norm_type)


@pytest.mark.parametrize("dtypes", ["mixed", "mixed64"])
@pytest.mark.parametrize("norm_type", [0.0, 1.0, 3.0, 0.5, -math.inf], ids=lambda p: f"p{p:g}")
def test_global_norm_any_order(emu, gen, norm_type, dtypes):
    """The orders beyond 2 and inf against torch.linalg.vector_norm in float64 (mixed dtypes, unaligned)."""
    numels = [*ODD_SIZES, 3]
    tensors = rand_tensors(numels, list_dtypes(dtypes, gen, len(numels)), gen, unaligned=True)
    tensors[1][2] = 0.0  # the 0-"norm" counts nonzeros
    total, each = emu.global_norm(tensors, norm_type, per_tensor=True)
    if dtypes == "mixed64":
        assert_wide_norms(total, each, tensors, norm_type)
        return
    x64 = f64(tensors)
    want_each = torch.stack([torch.linalg.vector_norm(x, norm_type) for x in x64])
    want = torch.linalg.vector_norm(torch.cat(x64), norm_type)
    rtol = 0.0 if norm_type in (0.0, -math.inf) else 1e-4  # counts and minima are exact
    torch.testing.assert_close(total.double(), want, rtol=rtol, atol=0.0)
    torch.testing.assert_close(each.double(), want_each, rtol=rtol, atol=0.0)


# ---- unscale_ / clip_by_norm_ / clip_by_value_ -----------------------------------------------


def run_scale(target, tensors, mode, found, total_norm, max_norm, clip):
    if isinstance(target, Emulator):
        target.scale_(tensors, mode, inv_scale=torch.full((), 0.125), found_inf=found, total_norm=total_norm,
                      max_norm=max_norm, eps=1e-6, clip_value=clip)  # fmt: skip
    elif mode == "unscale":
        gradacc_ext.unscale_(tensors, torch.full((), 0.125), found, backend="ext")
    elif mode == "clip_norm":
        gradacc_ext.clip_by_norm_(tensors, total_norm, max_norm, 1e-6, backend="ext")
    else:
        gradacc_ext.clip_by_value_(tensors, clip, backend="ext")


# unscale_ refuses float64 (the binding); the clips take it and clip it in double
SCALE_CASES = [(d, m) for d in ("float32", "float16", "bfloat16", "float64", "mixed64")
               for m in ("unscale", "clip_norm", "clip_value") if m != "unscale" or "64" not in d]  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("dtypes", "mode"), SCALE_CASES, ids=[f"{d}-{m}" for d, m in SCALE_CASES])
def test_scale(emu, gen, dtypes, mode, layout):
    """float64 members are clipped in double, exactly torch's float64 arithmetic (with a float64
    total_norm, used as is); the others in float32 (the norm and clip value rounded to float)."""
    tensors = rand_tensors(ODD_SIZES, list_dtypes(dtypes, gen, len(ODD_SIZES)), gen, unaligned=layout == "unaligned")
    if mode == "unscale":
        tensors[3][100] = math.inf  # found_inf must see it; the product stays inf
    wide = any(t.dtype == F64 for t in tensors)
    total_norm = torch.full((), 4.0 + 8 * torch.rand((), generator=gen, dtype=F64).item(), dtype=F64 if wide else F32)
    max_norm, clip = 1.5, 0.75 + 2.0**-40  # the clip is no float32 value: float64 members keep it exactly

    def want_of(x: torch.Tensor, in_double: bool) -> torch.Tensor:
        if mode == "clip_value":
            c = clip if in_double else torch.tensor(clip, dtype=F32).item()
            return x.clamp(-c, c)
        norm = total_norm.item() if in_double else total_norm.float().item()
        return x * {"unscale": 0.125, "clip_norm": max_norm / (norm + 1e-6)}[mode]

    x64 = f64(tensors)
    want = [want_of(x, t.dtype == F64) for x, t in zip(x64, tensors, strict=True)]
    cpu = [t.clone() for t in tensors]
    found = torch.zeros(1)

    run_scale(emu, tensors, mode, found, total_norm, max_norm, clip)

    narrow = [i for i, t in enumerate(tensors) if t.dtype != F64]
    assert_close_list([tensors[i] for i in narrow], [want[i] for i in narrow], [x64[i].abs() for i in narrow], 3, mode)
    for i in set(range(len(tensors))) - set(narrow):
        assert torch.equal(tensors[i], want[i]), f"{mode}: float64 tensors[{i}] is not torch's float64 result"
    assert found.item() == (1.0 if mode == "unscale" else 0.0)
    if HAS_CPU_KERNELS:
        run_scale("ext", cpu, mode, torch.zeros(1), total_norm, max_norm, clip)
        assert_matches_cpu_kernels(tensors, cpu, f"{mode} vs CPU kernels")
