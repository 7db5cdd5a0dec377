"""gradacc_ext.utils against torch.nn.utils, case by case: the same fresh grads through torch's function
and ours, then the return value and its dtype and device, the grads afterwards, warnings and exceptions.

Tolerances: the fused path accumulates the norm in fp32 and rounds it to the result dtype once, and
computes the clip coefficient in fp32; torch rounds the per-tensor norms, the total and the coefficient
to the grads' dtype. So a result may differ by the rounding of the lowest-precision dtype involved, a
few units of it (TOL); 0, inf and -inf norms are exact either way, and clamping is exact.
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
import torch.nn.utils as tnu
from _devices import require_ext

from gradacc_ext import utils

P_VALUES = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, math.inf, -math.inf, 0.0]
KINDS = ["float16", "bfloat16", "float32", "float64", "mixed"]
LAYOUTS = ["contiguous", "channels_last", "sliced"]
# a few units of each type's rounding for the doubly rounded 16-bit results; fp32 and float64 sums in another order
TOL = {torch.float16: 4 * 2.0**-11, torch.bfloat16: 4 * 2.0**-8, torch.float32: 2e-5, torch.float64: 1e-12}
SHAPES = [(8, 3, 3, 3), (8,), (5, 7), (2, 4, 5, 3), ()]


def make_grads(kind: str, layout: str, device: str, gen: torch.Generator) -> list[torch.Tensor]:
    """Fresh grads shaped like a small conv net's (4-d weights, a bias, a matrix, a 0-dim scalar)."""
    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float32]
    out = []
    for i, shape in enumerate(SHAPES):
        dtype = dtypes[i] if kind == "mixed" else getattr(torch, kind)
        # std 0.1 keeps fp16's p = 0.5 norms (which grow like n^2) below its overflow (docs/migration.md: an overflowing
        # 16-bit total is inf in both, but ours still clips by the finite fp32 norm where torch zeroes)
        values = torch.randn(shape, generator=gen) * 0.1
        if layout == "sliced" and len(shape) >= 2:  # every other row of a bigger grad: not dense
            big = torch.randn((shape[0] * 2, *shape[1:]), generator=gen) * 0.1
            big[::2] = values
            t = big.to(dtype).to(device)[::2]
        else:
            t = values.to(dtype).to(device)
            if layout == "channels_last" and len(shape) == 4:
                t = t.to(memory_format=torch.channels_last)
        out.append(t)
    return out


def params_with(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Parameters whose .grad are clones of `grads` (same strides), plus one without a grad."""
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    params.append(torch.nn.Parameter(torch.zeros(3, device=grads[0].device)))  # .grad is None: skipped
    return params


def tol_of(tensors: list[torch.Tensor]) -> float:
    return max(TOL[t.dtype] for t in tensors)


def assert_same_norm(ours: torch.Tensor, theirs: torch.Tensor, norm_type: float, tol: float) -> None:
    assert ours.dtype == theirs.dtype and ours.device == theirs.device and ours.shape == theirs.shape
    exact = norm_type == 0.0 or math.isinf(norm_type)
    torch.testing.assert_close(ours, theirs, rtol=0.0 if exact else tol, atol=0.0, equal_nan=True)


def assert_same_grads(
    ours: list[torch.nn.Parameter], theirs: list[torch.nn.Parameter], tol: float | None = None
) -> None:
    """Equal within `tol` of the largest finite |grad|; tol None: two units of each grad's own dtype."""
    for a, b in zip(ours, theirs, strict=True):
        if b.grad is None:
            assert a.grad is None
            continue
        assert a.grad.dtype == b.grad.dtype and a.grad.stride() == b.grad.stride()
        t = 2 * TOL[a.grad.dtype] if tol is None else tol
        scale = b.grad.double().abs().nan_to_num(posinf=0.0).max().item() if b.grad.numel() else 0.0
        torch.testing.assert_close(a.grad.double(), b.grad.double(), rtol=t, atol=t * scale, equal_nan=True)


def run_both(fn_name: str, grads: list[torch.Tensor], *args, **kwargs):
    """Calls torch's and our `fn_name` on separate copies; returns (ours, theirs, params_ours, params_theirs)."""
    ours_p, theirs_p = params_with(grads), params_with(grads)
    theirs = getattr(tnu, fn_name)(theirs_p, *args, **kwargs)
    ours = getattr(utils, fn_name)(ours_p, *args, **kwargs)
    return ours, theirs, ours_p, theirs_p


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("norm_type", P_VALUES)
def test_clip_grad_norm_matches_torch(device, gen, norm_type, kind, layout):
    grads = make_grads(kind, layout, device, gen)
    full = float(tnu.get_total_norm(grads, norm_type))
    max_norm = full * float(torch.empty(()).uniform_(0.2, 0.8, generator=gen))  # clips
    ours, theirs, ours_p, theirs_p = run_both("clip_grad_norm_", grads, max_norm, norm_type)
    assert_same_norm(ours, theirs, norm_type, tol_of(grads))
    # torch's own definition in float64: ours computes the coefficient in fp32, so it is close to it
    norm64 = tnu.get_total_norm([g.double() for g in grads], norm_type)
    coef = (max_norm / (norm64 + 1e-6)).clamp(max=1.0)
    exact = [torch.nn.Parameter(g.clone()) for g in grads] + [ours_p[-1]]
    for p, g in zip(exact, grads, strict=False):
        p.grad = (g.double() * coef).to(g.dtype)
    assert_same_grads(ours_p, exact)
    if not (norm_type == -math.inf and tol_of(grads) > TOL[torch.float32]):
        # A 16-bit -inf norm is tiny, and torch's 16-bit coefficient max_norm / (norm + 1e-6) rounds
        # in fp16 subnormals, off by percents (docs/migration.md): there ours is compared with the float64 truth only.
        assert_same_grads(ours_p, theirs_p, 2 * tol_of(grads))


@pytest.mark.parametrize("foreach", [None, True, False])
@pytest.mark.parametrize("kind", ["float32", "mixed"])
def test_foreach_values(device, gen, kind, foreach):
    grads = make_grads(kind, "channels_last", device, gen)
    ours, theirs, ours_p, theirs_p = run_both("clip_grad_norm_", grads, 0.3, 2.0, foreach=foreach)
    assert_same_norm(ours, theirs, 2.0, tol_of(grads))
    assert_same_grads(ours_p, theirs_p, 2 * tol_of(grads))
    ours_p, theirs_p = params_with(grads), params_with(grads)
    tnu.clip_grad_value_(theirs_p, 0.4, foreach=foreach)
    utils.clip_grad_value_(ours_p, 0.4, foreach=foreach)
    assert_same_grads(ours_p, theirs_p, 0.0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("clip_value", [0.0, math.inf, -0.25, 0.6])
def test_clip_grad_value_matches_torch(device, gen, clip_value, kind, layout):
    grads = make_grads(kind, layout, device, gen)
    grads[0][0, 0, 1, 2] = math.nan  # NaN stays NaN
    ours, theirs, ours_p, theirs_p = run_both("clip_grad_value_", grads, clip_value)
    assert ours is None and theirs is None
    assert_same_grads(ours_p, theirs_p, 0.0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("norm_type", [2.0, 3.0, -math.inf])
def test_get_total_norm_and_clip_grads_with_norm_match_torch(device, gen, kind, norm_type):
    """The two halves, with torch's own total (of the grads' dtype) fed to ours and the other way round."""
    grads = make_grads(kind, "channels_last", device, gen)
    theirs_norm = tnu.get_total_norm(grads, norm_type)
    ours_norm = utils.get_total_norm(iter(grads), norm_type)  # any iterable, as in torch
    assert_same_norm(ours_norm, theirs_norm, norm_type, tol_of(grads))
    for total in (theirs_norm, ours_norm):
        _, _, ours_p, theirs_p = run_both("clip_grads_with_norm_", grads, 0.1, total)
        assert_same_grads(ours_p, theirs_p, 2 * tol_of(grads))


@pytest.mark.parametrize("max_norm", [math.inf, 0.0, -1.0])
def test_max_norm_inf_zero_and_negative(device, gen, max_norm):
    """inf: the norm without clipping (grads unchanged); 0: grads zeroed; negative: torch's arithmetic."""
    grads = make_grads("mixed", "channels_last", device, gen)
    ours, theirs, ours_p, theirs_p = run_both("clip_grad_norm_", grads, max_norm)
    assert_same_norm(ours, theirs, 2.0, tol_of(grads))
    assert_same_grads(ours_p, theirs_p, 2 * tol_of(grads))
    if max_norm == math.inf:
        assert all(torch.equal(p.grad, g) for p, g in zip(ours_p, grads, strict=False))


@pytest.mark.parametrize("error_if_nonfinite", [False, True])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("fn_name", ["clip_grad_norm_", "get_total_norm"])
def test_nonfinite_grads(device, gen, fn_name, bad, error_if_nonfinite):
    grads = make_grads("mixed", "contiguous", device, gen)
    grads[2][1, 1] = bad
    results = []
    for module in (tnu, utils):
        params = params_with(grads)
        first = params if fn_name == "clip_grad_norm_" else [p.grad for p in params if p.grad is not None]
        call = functools.partial(getattr(module, fn_name), first, *((1.0,) if fn_name == "clip_grad_norm_" else ()))
        try:
            results.append((call(error_if_nonfinite=error_if_nonfinite), params))
        except RuntimeError as exc:
            results.append((str(exc), params))
    (ours, ours_p), (theirs, theirs_p) = results[1], results[0]
    if error_if_nonfinite:
        assert isinstance(ours, str) and ours == theirs
    else:
        assert_same_norm(ours, theirs, 2.0, tol_of(grads))
    assert_same_grads(ours_p, theirs_p, 2 * tol_of(grads))  # an error writes nothing; NaN/0 where torch has


def test_accepted_inputs_single_tensor_generator_and_empties(device, gen):
    grads = make_grads("float32", "contiguous", device, gen)
    one_ours, one_theirs = params_with(grads[:1])[0], params_with(grads[:1])[0]
    ours, theirs = utils.clip_grad_norm_(one_ours, 0.5), tnu.clip_grad_norm_(one_theirs, 0.5)
    assert_same_norm(ours, theirs, 2.0, TOL[torch.float32])
    assert_same_grads([one_ours], [one_theirs], 2 * TOL[torch.float32])

    ours_p, theirs_p = params_with(grads), params_with(grads)
    ours = utils.clip_grad_norm_((p for p in ours_p), 0.5)
    theirs = tnu.clip_grad_norm_((p for p in theirs_p), 0.5)
    assert_same_norm(ours, theirs, 2.0, TOL[torch.float32])
    assert_same_grads(ours_p, theirs_p, 2 * TOL[torch.float32])

    for module in (tnu, utils):
        with pytest.warns(UserWarning, match=r"`parameters` is an empty generator, no gradient clipping will occur"):
            empty = module.clip_grad_norm_((p for p in []), 1.0)
        assert empty.dtype == torch.float32 and empty.device.type == "cpu" and empty.item() == 0.0
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an empty list (not a generator) and grad-less params: no warning
            no_grads = [torch.nn.Parameter(torch.ones(2, device=device))]
            assert module.clip_grad_norm_([], 1.0).item() == 0.0
            assert module.clip_grad_norm_(no_grads, 1.0).item() == 0.0
            module.clip_grads_with_norm_(no_grads, 1.0, torch.tensor(2.0))
            assert module.get_total_norm([]).item() == 0.0


def test_exceptions_match_torch(device, gen):
    """What torch refuses, ours refuses with the same exception type."""
    grads = make_grads("float32", "contiguous", device, gen)
    cases = {
        "float total_norm": lambda m: m.clip_grads_with_norm_(params_with(grads), 1.0, 2.0),
        "inf norm of an empty grad": lambda m: m.clip_grad_norm_(params_with([*grads, grads[0][:0]]), 1.0, math.inf),
        "max_norm not a number": lambda m: m.clip_grad_norm_(params_with(grads), "big"),
        "norm_type not a number": lambda m: m.get_total_norm(grads, "l2"),
        # torch's grouping helper refuses an empty list: a torch quirk, kept (ours runs torch's code here)
        "clip_grad_value_ without grads": lambda m: m.clip_grad_value_([torch.nn.Parameter(torch.ones(2))], 1.0),
    }
    for what, call in cases.items():
        kinds = []
        for module in (tnu, utils):
            with pytest.raises(Exception) as info:  # noqa: PT011 - the type is what is compared
                call(module)
            kinds.append(type(info.value))
        assert kinds[0] is kinds[1], what


def test_channels_last_grads_run_fused_in_place(device, gen, monkeypatch):
    """A channels_last conv net's grads: no call into torch's clipping, no copy of any grad."""
    require_ext(device)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3)).to(device)
    model = model.to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 9, 9, generator=gen).to(device).to(memory_format=torch.channels_last)
    model(x).square().sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert any(not g.is_contiguous() for g in grads)
    theirs_p = params_with(grads)
    theirs = tnu.clip_grad_norm_(theirs_p, 0.1)
    for name in ("get_total_norm", "clip_grads_with_norm_", "clip_grad_value_"):
        monkeypatch.setattr(tnu, name, lambda *a, **k: pytest.fail("fell back to torch"))
    where = [(g.data_ptr(), g.stride()) for g in grads]
    ours = utils.clip_grad_norm_(model.parameters(), 0.1)
    utils.clip_grad_value_(model.parameters(), 1e-3)
    assert [(p.grad.data_ptr(), p.grad.stride()) for p in model.parameters()] == where
    assert_same_norm(ours, theirs, 2.0, TOL[torch.float32])
