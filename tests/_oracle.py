"""Shared helpers of the op tests: random inputs, the float64 oracle, and error bounds.

The oracle is gradacc_ext.reference run on float64 copies (it computes in
float64 then). Tolerances are derived from how the kernels round, not tuned:

* element results: every fp32 rounding of the kernels' element math costs at
  most one unit roundoff (2^-24) of the magnitude it rounds, so a result built
  from k roundings of values of size <= m is within k * 2^-24 * m of the exact
  value; a 16-bit result adds half an ulp of that type for the final store.
* L2 norms: an fp32 sum of n squares added one after another has a relative
  error that grows like 2^-24 * sqrt(n) (random-walk rounding); the bound
  below allows ~7 standard deviations over the longest sequential run of the
  kernels (a chunk lane of at most 65536 / 8 elements, then chunk partials).
* inf norms and clip_by_value are exact.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence

import pytest
import torch

U32 = 2.0**-24  # fp32 unit roundoff
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOW = (torch.float16, torch.bfloat16)
# (mantissa bits, smallest normal exponent) of each kernel dtype
_FORMAT = {torch.float32: (23, -126), torch.float16: (10, -14), torch.bfloat16: (7, -126)}
_CHUNK, _LANES = 65536, 8

ODD_SIZES = (1, 7, 65535, 65536, 65537, 131073)


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rand(
    shape: int | Sequence[int],
    dtype: torch.dtype,
    device: str | torch.device,
    gen: torch.Generator,
    *,
    unaligned: bool = False,
    std: float = 1.0,
) -> torch.Tensor:
    """Fresh normal(0, std) data of `dtype` (never all zero).

    unaligned=True returns `storage[1:]`: contiguous, but its data pointer is
    one element past an allocation, so not 16-byte aligned.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    values = (torch.randn(shape, generator=gen) * std).to(dtype)
    if not unaligned:
        return values.to(device)
    out = torch.empty(values.numel() + 1, dtype=dtype, device=device)[1:].view(shape)
    assert out.storage_offset() == 1 and out.is_contiguous()
    return out.copy_(values)


def rand_list(
    numels: Sequence[int],
    dtypes: torch.dtype | Sequence[torch.dtype],
    device: str | torch.device,
    gen: torch.Generator,
    *,
    unaligned: bool = False,
    std: float = 1.0,
) -> list[torch.Tensor]:
    if isinstance(dtypes, torch.dtype):
        dtypes = [dtypes] * len(numels)
    return [rand(n, d, device, gen, unaligned=unaligned, std=std) for n, d in zip(numels, dtypes, strict=True)]


def small_sizes(gen: torch.Generator, count: int = 2000, high: int = 200) -> list[int]:
    """`count` random sizes in [1, high): the many-small-tensors case."""
    return torch.randint(1, high, (count,), generator=gen).tolist()


def random_dtypes(gen: torch.Generator, count: int) -> list[torch.dtype]:
    idx = torch.randint(0, len(DTYPES), (count,), generator=gen).tolist()
    return [DTYPES[i] for i in idx]


def f64(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().to(torch.float64, copy=True) for t in tensors]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (NaN-safe, -0.0-aware comparison)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).clone()


def snapshot(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [bits(t) for t in tensors]


def assert_bits_unchanged(before: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], what: str = "") -> None:
    for i, (b, t) in enumerate(zip(before, tensors, strict=True)):
        assert torch.equal(b, bits(t)), f"{what}[{i}] was modified"


def assert_raise_alike(calls: Iterable[Callable[[], object]], exc: type[Exception], match: str) -> None:
    """The error contract of the two backends: every call raises `exc` matching `match`, all with the same
    type and the same message, word for word (dtype and layout names included)."""
    raised = []
    for call in calls:
        with pytest.raises(exc, match=match) as info:
            call()
        raised.append((type(info.value), str(info.value)))
    assert all(r == raised[0] for r in raised), raised


def assert_bitwise_equal(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Equal bit for bit, except that any NaN matches any NaN (payloads may differ)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    got, want = got.detach().cpu().reshape(-1), want.detach().cpu().reshape(-1)
    nan_g, nan_w = torch.isnan(got), torch.isnan(want)
    assert torch.equal(nan_g, nan_w), f"{what}: NaN positions differ at {torch.nonzero(nan_g != nan_w)[:5].tolist()}"
    as_int = {8: torch.int64, 4: torch.int32, 2: torch.int16}[got.element_size()]
    differ = (got.view(as_int) != want.view(as_int)) & ~nan_w
    if differ.any():
        i = int(torch.nonzero(differ)[0])
        raise AssertionError(
            f"{what}: {int(differ.sum())} elements differ; first at {i}: got {got[i].item()!r}, want {want[i].item()!r}"
        )


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ulp of `dtype` at the float64 values x (subnormal spacing below the normal range)."""
    mant, min_exp = _FORMAT[dtype]
    _, exp = torch.frexp(x.to(torch.float64))  # x = m * 2^exp with 0.5 <= |m| < 1 (exp = 0 for x = 0)
    exp = torch.where(x == 0, min_exp, (exp - 1).clamp(min=min_exp))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), exp - mant)


def assert_close(
    got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, roundings: int, what: str = "", ulps: float = 0.5
) -> None:
    """got (any kernel dtype) against the float64 oracle `want`.

    Bound: `roundings` fp32 roundings of values of size `magnitude`, plus `ulps`
    of got's dtype for the final store of a 16-bit result (half an ulp rounding
    to nearest, one for stochastic rounding, which may pick either neighbour). Non-finite
    oracle values must be matched exactly (NaN by NaN, +-Inf by the same Inf).
    """
    assert want.dtype == torch.float64 and got.shape == want.shape, what
    got64 = got.detach().to(torch.float64).cpu()
    want, magnitude = want.cpu(), magnitude.cpu()
    finite = torch.isfinite(want)
    assert torch.equal(torch.isnan(got64), torch.isnan(want)), f"{what}: NaN positions differ"
    assert torch.equal(got64[~finite & ~torch.isnan(want)], want[~finite & ~torch.isnan(want)]), f"{what}: Inf differ"
    bound = roundings * U32 * magnitude
    if got.dtype != torch.float32:
        bound = bound + ulps * ulp(torch.maximum(got64.abs(), want.abs()), got.dtype)
    err = (got64 - want).abs()
    bad = finite & ~(err <= bound)  # also catches a NaN/Inf where the oracle is finite
    if bad.any():
        i = int(torch.nonzero(bad.view(-1))[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements out of bound; first at {i}: got "
            f"{got64.view(-1)[i].item()!r}, want {want.view(-1)[i].item()!r}, bound {bound.view(-1)[i].item()!r}"
        )


def assert_close_list(
    got: Sequence[torch.Tensor],
    want: Sequence[torch.Tensor],
    magnitude: Sequence[torch.Tensor],
    roundings: int,
    what: str = "",
) -> None:
    """assert_close over whole lists at once (grouped by dtype: thousands of tensors stay fast)."""
    assert len(got) == len(want) == len(magnitude), what
    groups: dict[torch.dtype, tuple[list, list, list]] = {}
    for g, w, m in zip(got, want, magnitude, strict=True):
        group = groups.setdefault(g.dtype, ([], [], []))
        for part, t in zip(group, (g, w, m), strict=True):
            part.append(t.detach().reshape(-1).cpu())
    for dtype, (g, w, m) in groups.items():
        assert_close(torch.cat(g), torch.cat(w), torch.cat(m), roundings, what=f"{what} ({name(dtype)} elements)")


def norm_rtol(numels: Sequence[int]) -> float:
    """Relative bound of an fp32-accumulated L2 norm (see the module docstring)."""
    lane = min(max(numels, default=0), _CHUNK) / _LANES
    chunks = sum(-(-n // _CHUNK) for n in numels)
    return U32 * (4 + 2 * math.sqrt(lane + chunks))


def oracle_norms(tensors: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Each tensor's float64 norm of the values as stored (0 for an empty tensor), on the CPU."""
    out = []
    for t in tensors:
        x = t.detach().to(torch.float64).reshape(-1)
        if x.numel() == 0:
            out.append(torch.zeros((), dtype=torch.float64, device=x.device))
        elif norm_type == math.inf:
            out.append(x.abs().amax())  # amax propagates NaN
        else:
            out.append(x.square().sum().sqrt())
    return torch.stack(out).cpu() if out else torch.zeros(0, dtype=torch.float64)


def oracle_norm(tensors: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The float64 norm of a whole list (0 for an empty list), on the CPU."""
    each = oracle_norms(tensors, norm_type)
    if norm_type == math.inf:
        return each.amax() if each.numel() else torch.zeros((), dtype=torch.float64)
    return each.square().sum().sqrt()


def _check_norms(got: torch.Tensor, want: torch.Tensor, rtol: torch.Tensor, norm_type: float, what: str) -> None:
    got = got.detach().to(torch.float64).cpu().reshape(want.shape)
    if norm_type == math.inf:
        rtol = torch.zeros_like(rtol)  # a max of exactly converted values: exact
    same_nonfinite = (got.isnan() & want.isnan()) | (got == want)
    ok = same_nonfinite | (torch.isfinite(want) & ((got - want).abs() <= rtol * want))
    if not ok.all():
        i = int(torch.nonzero(~ok.reshape(-1))[0])
        raise AssertionError(
            f"{what}: {int((~ok).sum())} norms off; first at {i}: got {got.reshape(-1)[i].item()!r}, "
            f"want {want.reshape(-1)[i].item()!r} (rtol {rtol.reshape(-1)[i].item():.2e})"
        )


def assert_norm_close(got: torch.Tensor, tensors: Sequence[torch.Tensor], norm_type: float, what: str = "") -> None:
    """A one-element float32 norm against the float64 norm of the list `tensors`."""
    assert got.dtype == torch.float32 and got.numel() == 1, what
    want = oracle_norm(tensors, norm_type)
    rtol = torch.tensor(norm_rtol([t.numel() for t in tensors]), dtype=torch.float64)
    _check_norms(got, want, rtol, norm_type, what)


def assert_per_tensor_norms(got: torch.Tensor, tensors: Sequence[torch.Tensor], norm_type: float) -> None:
    """global_norm(..., per_tensor=True)'s second output against each tensor's float64 norm."""
    assert got.dtype == torch.float32 and got.shape == (len(tensors),), (got.dtype, got.shape)
    rtol = torch.tensor([norm_rtol([t.numel()]) for t in tensors], dtype=torch.float64)
    _check_norms(got, oracle_norms(tensors, norm_type), rtol, norm_type, "per-tensor norms")


@contextlib.contextmanager
def cpu_threads(n: int) -> Iterator[None]:
    """Runs the block with `n` torch CPU threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
