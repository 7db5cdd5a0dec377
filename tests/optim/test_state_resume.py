"""bf16 and int8 states over time: a resumed run (state_dict saved mid-run, loaded into a fresh optimizer built
with another seed) is bit-identical to the uninterrupted one, a skipped step (found_inf) writes nothing, and the
accumulator's fused tail with an int8 FusedAdamW equals stepping it by hand on the accumulated gradients."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from _optim_inputs import OPTIMIZERS

from gradacc_ext import GradientAccumulator
from gradacc_ext.accumulate.config import GradientAccumulationConfig
from gradacc_ext.optim import FusedAdamW

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
OPTIONS = {"adamw": {"lr": 1e-2}, "sgd": {"lr": 0.05, "momentum": 0.9}, "lion": {"lr": 1e-3}}
SIZES = [(40, 130), (33,)]  # 5200 elements: int8 codes with a partial last block; 33: fp32 states
CASES = [
    pytest.param(info, state_dtype, param_dtype, id=f"{info.name}-{state_dtype}-{str(param_dtype)[6:]}")
    for info in OPTIMIZERS
    for state_dtype in ("bf16", "int8")
    for param_dtype in (torch.float32, torch.bfloat16)
]


def make(info, state_dtype, param_dtype, seed_params: int, seed: int) -> tuple[torch.optim.Optimizer, list]:
    gen = torch.Generator().manual_seed(seed_params)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(param_dtype)) for s in SIZES]
    mode = "stochastic" if param_dtype == torch.bfloat16 else "master"
    return info.fused(params, **OPTIONS[info.name], state_dtype=state_dtype, param_mode=mode, seed=seed), params


def run(opt: torch.optim.Optimizer, params: list, gen: torch.Generator, steps: int) -> None:
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def snapshot(opt: torch.optim.Optimizer, params: list) -> list:
    """Every param and state value, for bit comparisons (tensors cloned, names as they are)."""
    values = [p.detach().clone() for p in params]
    for p in params:
        for key in sorted(opt.state[p]):
            value = opt.state[p][key]
            values.append((key, value.clone() if torch.is_tensor(value) else value))
    return values


def assert_identical(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if torch.is_tensor(x):
            assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        elif isinstance(x, tuple) and torch.is_tensor(x[1]):
            assert x[0] == y[0] and x[1].dtype == y[1].dtype and torch.equal(x[1], y[1]), x[0]
        else:
            assert x == y


@pytest.mark.parametrize(("info", "state_dtype", "param_dtype"), CASES)
def test_resume_is_bit_identical_to_the_uninterrupted_run(gen, info, state_dtype, param_dtype):
    seed_params, seed = int(torch.randint(0, 2**31, (), generator=gen)), 1234
    whole, whole_params = make(info, state_dtype, param_dtype, seed_params, seed)
    run(whole, whole_params, torch.Generator().manual_seed(seed_params + 1), 6)

    first, first_params = make(info, state_dtype, param_dtype, seed_params, seed)
    data = torch.Generator().manual_seed(seed_params + 1)
    run(first, first_params, data, 3)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    # a fresh optimizer on the params as they stand, built with another seed: the checkpoint's groups bring it
    params = [torch.nn.Parameter(p.detach().clone()) for p in first_params]
    mode = "stochastic" if param_dtype == torch.bfloat16 else "master"
    second = info.fused(params, **OPTIONS[info.name], state_dtype=state_dtype, param_mode=mode, seed=99)
    second.load_state_dict(torch.load(buffer, weights_only=True))
    run(second, params, data, 3)
    assert_identical(snapshot(second, params), snapshot(whole, whole_params))


@pytest.mark.parametrize(("info", "state_dtype", "param_dtype"), CASES)
def test_a_skipped_step_writes_nothing(gen, info, state_dtype, param_dtype):
    opt, params = make(info, state_dtype, param_dtype, int(torch.randint(0, 2**31, (), generator=gen)), 5)
    run(opt, params, gen, 2)  # states, scales and codes away from their fresh zeros
    before = snapshot(opt, params)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    opt.step(found_inf=torch.ones(()))
    assert_identical(snapshot(opt, params), before)


def test_the_fused_tail_with_int8_states_equals_stepping_by_hand(gen):
    """4 micro-batches a window: the tail steps from the fp32 buffers with grad_mult 1/4; by hand, the same
    optimizer steps from .grad (autograd's sum of the same micro-batch gradients) with grad_scale 4."""
    torch.manual_seed(int(torch.randint(0, 2**31, (), generator=gen)))
    model = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Tanh(), torch.nn.Linear(80, 3))
    ref = copy.deepcopy(model)
    make_opt = lambda m: FusedAdamW(m.parameters(), lr=1e-2, weight_decay=0.05, state_dtype="int8")  # noqa: E731
    opt, ref_opt = make_opt(model), make_opt(ref)
    acc = GradientAccumulator(model, opt, GradientAccumulationConfig(accumulation_steps=4, fused_step=True))
    batches = [(torch.randn(6, 64, generator=gen), torch.randn(6, 3, generator=gen)) for _ in range(12)]
    for x, y in batches:
        with acc.micro_step():
            acc.backward(F.mse_loss(model(x), y))
    for start in range(0, len(batches), 4):
        ref_opt.zero_grad(set_to_none=True)
        for x, y in batches[start : start + 4]:
            F.mse_loss(ref(x), y).backward()
        ref_opt.step(grad_scale=torch.tensor(4.0))
    assert acc.get_accumulation_stats()["fused_step"] is True and acc._end.tail.calls == 3
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.uint8
    assert_identical(snapshot(opt, list(model.parameters())), snapshot(ref_opt, list(ref.parameters())))
