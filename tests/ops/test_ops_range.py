"""Argument range: the kernels compute in float32, so a finite double beyond float32's range (eps=1e39,
a scale, max_norm or clip_value of 1e39) is a ValueError naming the argument, on both backends, with
nothing written. Inf/NaN keep their own rules (tests/ops/test_ops_errors.py)."""

from __future__ import annotations

import pytest
import torch
from _oracle import assert_bits_unchanged, snapshot
from test_ops_errors import OPS, Inputs

import gradacc_ext

F32_MAX = torch.finfo(torch.float32).max
TOO_BIG = (1e39, -1e39, 3.4028236e38)  # the last is just above float32's max

# (op, Inputs field, the name the message uses): every float argument of every public op
RANGE_ARGS = [
    ("accumulate_", "scale", "alpha"),
    ("accumulate_final_", "scale", "alpha"),
    ("clip_by_norm_", "max_norm", "max_norm"),
    ("clip_by_norm_", "eps", "eps"),
    ("clip_grad_norm_", "max_norm", "max_norm"),
    ("clip_grad_norm_", "eps", "eps"),
    ("clip_by_value_", "clip_value", "clip_value"),
]
CASES = [
    pytest.param(op, field, arg, v, id=f"{op}-{field}-{v:g}")
    for op, field, arg in RANGE_ARGS
    for v in TOO_BIG
    if v > 0 or field in ("scale", "clip_value")  # a negative max_norm or eps fails its sign check first
]


@pytest.mark.parametrize(("op", "field", "arg", "value"), CASES)
def test_finite_value_beyond_float32_is_rejected(device, backend, gen, op, field, arg, value):
    inputs = Inputs.make(device, gen)
    setattr(inputs, field, value)
    watched = inputs.all_tensors()
    before = snapshot(watched)
    with pytest.raises(ValueError, match=rf"{arg} = .* does not fit in float32"):
        OPS[op](inputs, backend)
    assert_bits_unchanged(before, watched, "input tensors")


@pytest.mark.parametrize(("op", "field", "arg"), [pytest.param(*a, id=f"{a[0]}-{a[1]}") for a in RANGE_ARGS])
def test_float32_max_itself_is_accepted(device, backend, gen, op, field, arg):
    inputs = Inputs.make(device, gen)
    setattr(inputs, field, F32_MAX if field != "scale" else 1.0)
    OPS[op](inputs, backend)  # the boundary is in range: no error


def test_every_float_argument_of_the_schemas_is_covered():
    """A float in an op schema that no case above covers would be an unchecked conversion."""
    if not gradacc_ext.resolve_backend("cpu")[0] == "ext":
        pytest.skip("the compiled extension is not loaded")
    covered = {(op, arg) for op, _, arg in RANGE_ARGS}
    for op in ("accumulate_", "accumulate_final_", "global_norm", "unscale_", "clip_by_norm_", "clip_by_value_"):
        schema = getattr(torch.ops.gradacc, op).default._schema
        for a in schema.arguments:
            if str(a.type) == "float" and a.name != "norm_type":  # norm_type is matched exactly, never converted
                assert (op, a.name) in covered, f"{op}({a.name}) has no range test"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("clip_value", [7e4, F32_MAX])
def test_clip_value_beyond_a_16bit_range_matches_the_kernels(ext_device, gen, dtype, clip_value):
    """The reference once refused a clip_value above the tensor dtype's max; it clamps in float32 now,
    like the kernels, so both backends agree bit for bit (inf included)."""
    x = (torch.randn(257, generator=gen) * 1e4).to(dtype)
    x[:3] = torch.tensor([float("inf"), -float("inf"), torch.finfo(dtype).max])
    ext, ref = x.clone().to(ext_device), x.clone().to(ext_device)
    gradacc_ext.clip_by_value_([ext], clip_value, backend="ext")
    gradacc_ext.clip_by_value_([ref], clip_value, backend="torch")
    assert torch.equal(ext.view(torch.int16), ref.view(torch.int16))


def test_a_float64_list_takes_any_finite_value(device, backend, gen):
    """float64 lists are clipped in double, so a value beyond float32 is in range for them; one float32
    tensor in the list makes it an error again."""
    x = [torch.randn(33, generator=gen, dtype=torch.float64).to(device) * 1e300 for _ in range(2)]
    want = [t.clamp(-1e39, 1e39) for t in x]
    gradacc_ext.clip_by_value_(x, 1e39, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(x, want, strict=True))
    norm = torch.tensor(1e40, dtype=torch.float64, device=device)
    want = [t * (1e39 / (1e40 + 1e38)) for t in x]
    gradacc_ext.clip_by_norm_(x, norm, 1e39, 1e38, backend=backend)
    for a, b in zip(x, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-15, atol=0)
    mixed = [*x, torch.randn(3, generator=gen).to(device)]
    with pytest.raises(ValueError, match=r"clip_value = .* does not fit in float32"):
        gradacc_ext.clip_by_value_(mixed, 1e39, backend=backend)
