"""state_dtype on FusedAdamW / FusedLion / FusedSGD: bad input refused by name, the int8_min_numel split (one op
call per storage), exact bytes of state per param, repr, the accumulator's stats, and a state left in another
storage refused before anything is written."""

from __future__ import annotations

import pytest
import torch
from _optim_inputs import OPTIMIZERS

from gradacc_ext import GradientAccumulator
from gradacc_ext.accumulate.config import GradientAccumulationConfig
from gradacc_ext.ops.quant_maps import BLOCK
from gradacc_ext.optim import FusedAdamW

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
ROWS = [pytest.param(info, id=info.name) for info in OPTIMIZERS]
OPTIONS = {"adamw": {"lr": 1e-2}, "sgd": {"lr": 0.05, "momentum": 0.9}, "lion": {"lr": 1e-3}}


def used_keys(info) -> tuple[str, ...]:
    return info.fused._state_keys[:2] if info.name == "adamw" else info.fused._state_keys


def step_once(opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    opt.step()


@pytest.mark.parametrize("info", ROWS)
@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"state_dtype": "int4"}, r"state_dtype must be one of \('fp32', 'bf16', 'int8'\), got 'int4'"),
        ({"state_dtype": torch.bfloat16}, "state_dtype must be one of"),
        ({"int8_min_numel": -1}, r"int8_min_numel must be an int >= 0 .*got -1"),
        ({"int8_min_numel": 4096.0}, "int8_min_numel must be an int"),
        ({"int8_min_numel": True}, "int8_min_numel must be an int"),
    ],
)
def test_bad_state_options_are_refused_naming_the_argument(info, options, match):
    with pytest.raises(ValueError, match=f"{info.fused.__name__}: {match}"):
        info.fused([torch.nn.Parameter(torch.ones(3))], **OPTIONS[info.name], **options)
    opt = info.fused([torch.nn.Parameter(torch.ones(3))], **OPTIONS[info.name])
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], **options})
    assert len(opt.param_groups) == 1


def test_int8_with_amsgrad_is_refused_at_construction_and_per_group():
    with pytest.raises(ValueError, match="amsgrad=True is not supported with state_dtype='int8'.*'bf16' or 'fp32'"):
        FusedAdamW([torch.nn.Parameter(torch.ones(3))], amsgrad=True, state_dtype="int8")
    with pytest.raises(ValueError, match="amsgrad=True is not supported with state_dtype='int8'"):
        FusedAdamW([{"params": [torch.nn.Parameter(torch.ones(3))], "amsgrad": True}], state_dtype="int8")
    FusedAdamW([torch.nn.Parameter(torch.ones(3))], amsgrad=True, state_dtype="bf16")  # bf16 takes amsgrad


@pytest.mark.parametrize("info", ROWS)
def test_int8_min_numel_splits_a_group_into_one_call_per_storage(gen, info, monkeypatch):
    sizes = [(64, 64), (4095,), (100, 100), (7,)]  # 4096 and 10000 quantized, 4095 and 7 fp32
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in sizes]
    params.append(torch.nn.Parameter(torch.randn(5000, generator=gen, dtype=torch.float64)))  # fp64: fp64 state
    opt = info.fused(params, **OPTIONS[info.name], state_dtype="int8")
    assert opt.state_storages() == [{"int8": 2, "fp32": 3}]
    calls = []
    op = info.fused._op
    monkeypatch.setattr(info.fused, "_op", staticmethod(lambda *a, **k: (calls.append(len(a[0])), op(*a, **k))))
    step_once(opt, gen)
    assert sorted(calls) == [2, 3]  # one call per storage kind present
    dtypes = [opt.state[p][used_keys(info)[0]].dtype for p in params]
    assert dtypes == [torch.uint8, torch.float32, torch.uint8, torch.float32, torch.float64]
    assert opt.state[params[2]][used_keys(info)[0] + "_scales"].shape == (-(-10000 // BLOCK),)
    opt.param_groups[0]["int8_min_numel"] = 0
    assert opt.state_storages() == [{"int8": 4, "fp32": 1}]


def state_bytes(opt: torch.optim.Optimizer, param: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in opt.state[param].values() if torch.is_tensor(t))


@pytest.mark.parametrize("info", ROWS)
@pytest.mark.parametrize(("state_dtype", "per_element"), [("fp32", 4), ("bf16", 2), ("int8", 1)])
def test_bytes_of_state_per_param_are_exact(gen, info, state_dtype, per_element):
    """A bf16 param of 2**20 elements, stochastic rounding (no master): each state key costs per_element bytes
    an element, int8 adds one float32 scale per 256 elements; the step count is 4 bytes."""
    n = 1 << 20
    param = torch.nn.Parameter(torch.randn(n, generator=gen).to(torch.bfloat16))
    opt = info.fused([param], **OPTIONS[info.name], param_mode="stochastic", state_dtype=state_dtype)
    step_once(opt, gen)
    keys = len(used_keys(info))
    scales = keys * (n // BLOCK) * 4 if state_dtype == "int8" else 0
    assert state_bytes(opt, param) == keys * per_element * n + scales + 4
    if state_dtype == "int8" and info.name == "adamw":  # the figure: 1 + 1 + 2 x 4/256 bytes an element
        assert state_bytes(opt, param) - 4 == n * (1 + 1) + n * 2 * 4 // 256


def test_repr_shows_state_dtype_and_threshold():
    opt = FusedAdamW([torch.nn.Parameter(torch.ones(3))], state_dtype="int8", int8_min_numel=1024)
    assert "state_dtype: int8" in repr(opt) and "int8_min_numel: 1024" in repr(opt)


def test_accumulator_stats_name_each_groups_storage(gen):
    model = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Tanh(), torch.nn.Linear(80, 3))
    groups = [
        {"params": [model[0].weight, model[2].weight]},
        {"params": [model[0].bias, model[2].bias], "state_dtype": "bf16"},
    ]
    opt = FusedAdamW(groups, state_dtype="int8")
    with GradientAccumulator(model, opt, GradientAccumulationConfig(accumulation_steps=2)) as acc:
        assert acc.get_accumulation_stats()["optimizer_state_storage"] == [{"int8": 1, "fp32": 1}, {"bf16": 2}]
    plain = torch.optim.AdamW(model.parameters())
    with GradientAccumulator(model, plain, GradientAccumulationConfig(accumulation_steps=1)) as acc:
        assert acc.get_accumulation_stats()["optimizer_state_storage"] is None


def test_a_state_left_in_another_storage_is_refused_before_anything_is_written(gen):
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in (5000, 9)]
    opt = FusedAdamW(params, lr=1e-2)
    step_once(opt, gen)
    before = [p.detach().clone() for p in params], [opt.state[p]["exp_avg"].clone() for p in params]
    opt.param_groups[0]["state_dtype"] = "int8"  # the 9-element param stays fp32 and would step first
    with pytest.raises(
        ValueError, match="exp_avg is torch.float32, but its group stores 'int8'.*from_torch_state_dict"
    ):
        step_once(opt, gen)
    for p, old, m in zip(params, *before, strict=True):
        assert torch.equal(p.detach(), old) and torch.equal(opt.state[p]["exp_avg"], m)
