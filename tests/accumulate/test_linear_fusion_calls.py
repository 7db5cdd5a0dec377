"""Calls of a fused nn.Linear (accumulate/linear_fusion_calls.py): each gives what a plain nn.Linear gives.

Every call form plain nn.Linear accepts is compared, bit for bit, with an unfused twin model holding the same
float64 parameters: the `input=` keyword, torch.func.functional_call with other weights (with and without
grad), the per-sample-gradient recipe vmap(grad(functional_call)), vmap(model), torch.func.jvp, forward-mode
AD and nested-tensor inputs. Calls the fused node cannot serve run plain F.linear and are counted per reason
in stats.linear_fusion_unfused_calls. Inside micro_step(), unfused calls that reach the accumulator's own
parameters mix with fused calls in one window and still equal the plain full-batch loop.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from test_linear_fusion import FUSION, IN, OUT, TOL, assert_params_close, make_batches, make_model
from torch import nn
from torch.func import functional_call, grad, jvp, vmap

from gradacc_ext import GradientAccumulator
from gradacc_ext.accumulate.config import GradientAccumulationConfig

DTYPE = torch.float64
FUNCTORCH = "torch.func transform"
REPLACED = "not the parameter the accumulator was given"


def fused_and_twin(seed: int, **config) -> tuple[nn.Module, nn.Module, GradientAccumulator]:
    model = make_model(DTYPE, seed)
    twin = copy.deepcopy(model)  # before the accumulator: a plain model with the same parameters
    cfg = GradientAccumulationConfig(accumulation_steps=2, **FUSION, **config)
    return model, twin, GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)


def nothing_written(acc: GradientAccumulator) -> bool:
    """Whether no gradient reached the open window (the window's sums: which views hold a sum)."""
    return not acc._sums.indices()


def ema_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() + 0.01 * torch.randn_like(v) for k, v in model.named_parameters()}


def per_sample_grads(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The torch.func recipe: vmap over samples of grad of a functional_call loss."""
    params = {k: v.detach() for k, v in m.named_parameters()}

    def loss(p, xi, yi):
        return F.mse_loss(functional_call(m, p, (xi[None],)), yi[None])

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


def dual_tangent(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with fwAD.dual_level():
        return fwAD.unpack_dual(m(fwAD.make_dual(x, torch.ones_like(x)))).tangent


def no_grad_call(m: nn.Module, x: torch.Tensor, ema: dict) -> torch.Tensor:
    with torch.no_grad():
        return functional_call(m, ema, (x,))


# name -> (call(model, x, y, ema), reason substring counted per fused Linear call, or None: not counted)
CALLS = {
    "input_keyword": (lambda m, x, y, ema: m[2](input=torch.tanh(m[0](input=x))), None),
    "functional_call_own_params": (lambda m, x, y, ema: functional_call(m, dict(m.named_parameters()), (x,)), None),
    "functional_call_ema": (lambda m, x, y, ema: functional_call(m, ema, (x,)), REPLACED),
    "functional_call_no_grad": (lambda m, x, y, ema: no_grad_call(m, x, ema), None),
    "per_sample_grads": (lambda m, x, y, ema: per_sample_grads(m, x, y), FUNCTORCH),
    "vmap_model": (lambda m, x, y, ema: vmap(m)(x), FUNCTORCH),
    "func_jvp": (lambda m, x, y, ema: jvp(m, (x,), (torch.ones_like(x),))[1], FUNCTORCH),
    "nested_input": (
        lambda m, x, y, ema: m(torch.nested.as_nested_tensor(list(x), layout=torch.jagged)).values(),
        "Nested",
    ),
    "forward_ad": (lambda m, x, y, ema: dual_tangent(m, x), "forward-mode AD"),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_call_forms_equal_an_unfused_twin_exactly(name):
    call, reason = CALLS[name]
    model, twin, acc = fused_and_twin(seed=3)
    x, y = make_batches(1, DTYPE, 3)[0]
    ema = ema_of(model)
    got, want = call(model, x, y, ema), call(twin, x, y, ema)
    if isinstance(got, dict):  # per-sample gradients, by parameter name
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    else:
        assert torch.equal(got, want)
    calls = acc.stats.linear_fusion_unfused_calls
    if reason is None:
        assert calls == {}
    else:
        assert list(calls.values()) == [2] and reason in next(iter(calls))  # once per Linear of the model
        assert acc.get_accumulation_stats()["linear_fusion_unfused_calls"] == calls
        acc.reset_stats()
        assert acc.stats.linear_fusion_unfused_calls == {}
    assert nothing_written(acc)  # nothing reached the window outside micro_step()
    acc.close()


@pytest.mark.parametrize("bucket", [1, 1 << 20])
def test_unfused_calls_on_owned_parameters_mix_with_fused_ones_in_a_window(bucket):
    """Each micro-step's loss uses fused calls and three kinds of unfused calls of the same Linears: vmap(model),
    forward-mode AD, and functional_call with a weight computed from the owned one. The unfused gradients reach
    the views through the hooks (in either order with the fused writes), each counted once: the window equals
    the plain full-batch loop, and the unfused calls are counted per reason."""
    n, seed = 2, 17
    batches = make_batches(4, DTYPE, seed)
    model, ref, acc = fused_and_twin(seed, bucket_size_bytes=bucket)

    def loss(m: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        scaled = {"2.weight": 1.5 * m[2].weight}  # a parametrization-like weight: its gradient reaches m[2].weight
        terms = (m(x), vmap(m)(x.flip(0)), dual_tangent(m, x) + m(x), functional_call(m, scaled, (x,)))
        return sum(F.mse_loss(out, y) for out in terms)

    for batch in batches:
        with acc.micro_step():
            acc.backward(loss(model, batch))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for start in range(0, len(batches), n):
        opt.zero_grad()
        (sum(loss(ref, b) for b in batches[start : start + n]) / n).backward()
        opt.step()
    assert_params_close(model, ref, DTYPE)
    calls = acc.stats.linear_fusion_unfused_calls
    tags = (FUNCTORCH, "forward-mode AD", REPLACED)
    assert len(calls) == 3  # per micro-step: both Linears under vmap and forward AD, the swapped one only
    assert {tag: sum(v for k, v in calls.items() if tag in k) for tag in tags} == {
        FUNCTORCH: 8,
        "forward-mode AD": 8,
        REPLACED: 4,
    }


def test_nested_tensor_input_runs_unfused_and_reaches_the_buffers():
    model, twin, acc = fused_and_twin(seed=5)
    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(k, IN, generator=g, dtype=DTYPE) for k in (2, 5)]
    targets = [torch.randn(k, OUT, generator=g, dtype=DTYPE) for k in (2, 5)]

    def loss(m: nn.Module) -> torch.Tensor:
        out = m(torch.nested.nested_tensor(rows, layout=torch.jagged))
        return sum(F.mse_loss(o, t, reduction="sum") for o, t in zip(out.unbind(), targets, strict=True))

    with acc.micro_step():
        acc.backward(loss(model))
    loss(twin).backward()
    for view, p in zip(acc._buffers.views, twin.parameters(), strict=True):
        torch.testing.assert_close(view, p.grad, **TOL[DTYPE])
    assert list(acc.stats.linear_fusion_unfused_calls.values()) == [2]
    acc.close()


def test_a_replaced_parameter_runs_unfused_like_nn_linear():
    """`layer.weight = nn.Parameter(...)` while owned: the call runs plain F.linear, as nn.Linear does. The new
    parameter gets its gradient in .grad, the owned ones reach their views through the hooks or the fusion, and
    the window's step equals the plain loop's, whose optimizer also holds the old weight (no gradient: unmoved)."""
    model, twin, acc = fused_and_twin(seed=7)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    x, y = make_batches(1, DTYPE, 7)[0]
    old, old_value = model[2].weight, model[2].weight.detach().clone()
    new_weight = torch.randn_like(old)
    model[2].weight, twin[2].weight = nn.Parameter(new_weight.clone()), nn.Parameter(new_weight.clone())
    with acc.micro_step():
        acc.backward(F.mse_loss(model(x), y))
    assert acc.flush()
    F.mse_loss(twin(x), y).backward()
    twin_opt.step()
    assert torch.equal(old, old_value) and torch.equal(model[2].weight.grad, twin[2].weight.grad)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOL[DTYPE])
    assert REPLACED in next(iter(acc.stats.linear_fusion_unfused_calls))
    acc.close()


@pytest.mark.parametrize(
    "call",
    [lambda lin, x: lin(None), lambda lin, x: lin(x.float()), lambda lin, x: lin(x[..., 1:]), lambda lin, x: lin(x, x)],
    ids=["none_input", "dtype_mismatch", "shape_mismatch", "two_inputs"],
)
def test_bad_calls_raise_what_nn_linear_raises(call):
    """F.linear's own errors, word for word; a wrong argument list raises TypeError as nn.Linear.forward does."""
    model, twin, acc = fused_and_twin(seed=11)
    x = make_batches(1, DTYPE, 11)[0][0]
    errors = []
    for lin in (model[0], twin[0]):
        with pytest.raises((TypeError, RuntimeError)) as raised:
            call(lin, x)
        errors.append(raised.value)
    assert type(errors[0]) is type(errors[1])
    if "positional arguments" not in str(errors[1]):  # Linear.forward() vs the fused forward's name
        assert str(errors[0]) == str(errors[1])
    assert acc.stats.linear_fusion_unfused_calls == {} and nothing_written(acc)
    acc.close()
