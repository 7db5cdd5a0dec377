"""16-bit params (float32 grads and state): round-to-nearest, float32 master weights, and stochastic
rounding (unbiased, reproducible from the seed, the same bits on every backend)."""

from __future__ import annotations

import pytest
import torch
from _optim_inputs import make_inputs
from _oracle import LOW, assert_bitwise_equal, assert_close, name

from gradacc_ext.ops import adamw_step_, sgd_step_

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
SIZES = [7, 65537, 300]


def adamw(x, backend: str, mode: str, seed: int = 0) -> None:
    adamw_step_(x.params, x.grads, x.exp_avgs, x.exp_avg_sqs, x.steps, lr=1e-2, weight_decay=0.1,
                master_params=x.master_params, mode=mode, seed=seed, backend=backend)  # fmt: skip


@pytest.mark.parametrize("dtype", LOW, ids=name)
def test_nearest_rounds_the_fp32_update(device, backend, gen, dtype):
    """The 16-bit result is the float32 update (computed from the same state) rounded to nearest."""
    x = make_inputs(SIZES, dtype, device, gen, grad_dtype=torch.float32)
    wide = x.clone()
    wide.params = [p.float() for p in x.params]
    adamw(x, backend, "nearest")
    adamw(wide, "torch", "nearest")
    for got, want in zip(x.params, wide.params, strict=True):
        assert_close(got, want.double(), want.abs().double() + 1e-2, 8, "params")
    for got, want in zip(x.exp_avg_sqs, wide.exp_avg_sqs, strict=True):
        assert_close(got, want.double(), want.double(), 8, "exp_avg_sqs")


@pytest.mark.parametrize("dtype", LOW, ids=name)
def test_master_weights_step_like_fp32_params(device, backend, gen, dtype):
    """"master": the float32 masters take the float32 step and the params are their rounding."""
    x = make_inputs(SIZES, dtype, device, gen, grad_dtype=torch.float32, masters=True)
    wide = x.clone()
    wide.params, wide.master_params = [m.clone() for m in x.master_params], []
    adamw(x, backend, "master")
    adamw(wide, "torch", "nearest")
    for master, param, want in zip(x.master_params, x.params, wide.params, strict=True):
        assert_close(master, want.double(), want.abs().double() + 1e-2, 8, "master_params")
        assert_bitwise_equal(param, master.to(dtype), "params")


def quarter_step_inputs(dtype: torch.dtype, device: str, n: int):
    """Params at 1.0 and an SGD update landing a quarter of the way down to the next value below 1
    (exact in float32), so each element rounds down with probability 1/4 exactly."""
    below = 1.0 - 2.0 ** -(8 if dtype == torch.bfloat16 else 11)
    target = 1.0 - (1.0 - below) / 4
    params = [torch.ones(n, dtype=dtype, device=device)]
    grads = [torch.full((n,), 1.0 - target, device=device)]
    return params, grads, below


def sr_step(params, grads, backend: str, seed: int, device: str) -> None:
    step = torch.full((), 5.0, device=device)
    sgd_step_(params, grads, lr=1.0, steps=[step], mode="stochastic", seed=seed, backend=backend)


@pytest.mark.parametrize("dtype", LOW, ids=name)
def test_stochastic_rounding_is_unbiased_and_reproducible(device, backend, gen, dtype):
    n = 1 << 16
    seed = int(torch.randint(0, 2**62, (), generator=gen))
    params, grads, below = quarter_step_inputs(dtype, device, n)
    sr_step(params, grads, backend, seed, device)
    values = params[0].float().cpu()
    assert set(values.unique().tolist()) == {below, 1.0}  # only the two neighbours
    down = float((values == below).float().mean())
    sigma = (0.25 * 0.75 / n) ** 0.5
    assert abs(down - 0.25) < 5 * sigma, down  # unbiased: E[result] = the exact update

    again, _, _ = quarter_step_inputs(dtype, device, n)
    sr_step(again, grads, backend, seed, device)
    assert_bitwise_equal(again[0], params[0], "same seed")
    other, _, _ = quarter_step_inputs(dtype, device, n)
    sr_step(other, grads, backend, seed + 1, device)
    assert not torch.equal(other[0], params[0])


@pytest.mark.parametrize("dtype", LOW, ids=name)
def test_stochastic_rounding_draws_the_same_bits_on_every_backend(ext_device, gen, dtype):
    """The random bits depend only on (seed, step, position): the compiled kernel and the reference
    pick the same neighbour for every element, across tensors and chunk boundaries."""
    sizes = [70001, 3, 65536]
    results = []
    for backend in ("ext", "torch"):
        params = [torch.ones(n, dtype=dtype, device=ext_device) for n in sizes]
        grads = [torch.rand(n, generator=torch.Generator().manual_seed(n)).to(ext_device) * 2.0**-9 for n in sizes]
        step = torch.full((), 3.0, device=ext_device)
        sgd_step_(params, grads, lr=1.0, steps=[step], mode="stochastic", seed=11, backend=backend)
        results.append(params)
    for got, want in zip(*results, strict=True):
        assert_bitwise_equal(got, want, "ext vs reference")
