"""GPU-only checks of scripts/gpu_verify.sh (all skip without CUDA): a whole accumulation window
captured in a CUDA graph, a window under torch.cuda.set_sync_debug_mode("error"), each with the plain
tail and with the fused optimizer tail (adamw_step_ / sgd_step_), the accumulator's own fused window
under "error", and one tensor of more than 2**31 elements through every op and both optimizer steps."""

from __future__ import annotations

import math

import pytest
import torch
from _devices import CUDA_SKIP, require_ext
from _optim_inputs import StepInputs, make_inputs
from _oracle import assert_close_list, assert_norm_close, f64, rand_list

import gradacc_ext
from gradacc_ext import GradientAccumulationConfig, GradientAccumulator
from gradacc_ext.ops import DEFAULT_EPS, adamw_step_, sgd_step_
from gradacc_ext.optim import FusedAdamW

pytestmark = CUDA_SKIP
MICRO_STEPS = 4
NUMELS = [1, 7, 65535, 65537, 300_001, 4099]  # odd sizes, several chunks


def window(bufs, grads_per_step, inv_scale, found_inf, norm_out, max_norm, opt: StepInputs | None = None) -> None:
    """One accumulation window as GradientAccumulator runs it in one process: assign, accumulate, the last fold
    adding its sum of squares into norm_out (accumulate_final_), the norm and the grad multiplier on the device,
    then one unscale-and-clip pass (unscale_ by the multiplier) or, given optimizer state `opt`, the fused way
    through WindowEnd.close: one adamw_step_ (sgd_step_ if `opt` has no exp_avg_sqs)."""
    last = len(grads_per_step) - 1
    for k, grads in enumerate(grads_per_step[:last]):
        gradacc_ext.accumulate_(bufs, grads, 1.0 / (last + 1), assign=k == 0)
    norm_out.zero_()
    gradacc_ext.accumulate_final_(bufs, grads_per_step[last], found_inf, norm_out, 1.0 / (last + 1), assign=last == 0)
    norm_out.copy_(norm_out.sqrt() * inv_scale)  # the norm of the unscaled sums
    found_inf.copy_(found_inf.logical_or(~torch.isfinite(norm_out)))
    mult = (inv_scale * torch.clamp(max_norm / (norm_out + DEFAULT_EPS), max=1.0)).float()
    if opt is None:
        gradacc_ext.unscale_(bufs, mult.reshape(()), found_inf)
        return
    lr = torch.full((), 1e-2, device="cuda")
    if opt.exp_avg_sqs:
        adamw_step_(opt.params, bufs, opt.exp_avgs, opt.exp_avg_sqs, opt.steps, lr=lr, grad_mult=mult,
                    found_inf=found_inf)  # fmt: skip
    else:
        sgd_step_(opt.params, bufs, lr=lr, momentum=0.9, momentum_buffers=opt.exp_avgs, steps=opt.steps,
                  grad_mult=mult, found_inf=found_inf)  # fmt: skip


def window_inputs(gen):
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.bfloat16, torch.float16, torch.float32]
    grads = [rand_list(NUMELS, dtypes, "cuda", gen) for _ in range(MICRO_STEPS)]
    bufs = rand_list(NUMELS, torch.float32, "cuda", gen)
    scalars = dict(inv_scale=torch.full((), 0.5, device="cuda"), found_inf=torch.zeros(1, device="cuda"),
                   norm_out=torch.zeros((), device="cuda"))  # fmt: skip
    return bufs, grads, scalars


def tail_state(tail: str, gen) -> StepInputs | None:
    """Optimizer state over NUMELS for the fused tail ("adamw", "sgd"); None for the plain tail."""
    return None if tail == "plain" else make_inputs(NUMELS, torch.float32, "cuda", gen, optimizer=tail)


TAILS = ["plain", "adamw", "sgd"]


@pytest.mark.parametrize("tail", TAILS)
def test_cuda_graph_captures_a_whole_window(gen, tail):
    require_ext("cuda")
    bufs, grads, s = window_inputs(gen)
    opt = tail_state(tail, gen)
    initial = opt and opt.clone()
    eager_bufs = [b.clone() for b in bufs]
    eager = {k: v.clone() for k, v in s.items()}
    eager_opt = opt and opt.clone()
    window(eager_bufs, grads, eager["inv_scale"], eager["found_inf"], eager["norm_out"], 1.0, eager_opt)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (workspace allocations)
        window([b.clone() for b in bufs], grads, s["inv_scale"], s["found_inf"].clone(), s["norm_out"].clone(), 1.0,
               opt and opt.clone())  # fmt: skip
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        window(bufs, grads, s["inv_scale"], s["found_inf"], s["norm_out"], 1.0, opt)
    graph.replay()
    torch.cuda.synchronize()
    got_all = bufs + (opt.all_tensors() if opt else [])
    want_all = eager_bufs + (eager_opt.all_tensors() if eager_opt else [])
    for got, want in zip(got_all, want_all, strict=True):
        assert torch.equal(got, want)  # same kernels, same order: bitwise
    assert torch.equal(s["norm_out"], eager["norm_out"]) and torch.equal(s["found_inf"], eager["found_inf"])
    if opt:  # the step was taken (not skipped): every param moved
        assert s["found_inf"].item() == 0.0
        assert not any(torch.equal(p, p0) for p, p0 in zip(opt.params, initial.params, strict=True))


OPTIMIZERS = {
    "torch_adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "torch_sgd": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    "fused_adamw": lambda params: FusedAdamW(params, lr=1e-3),
}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_accumulator_window_takes_the_fused_tail_without_host_sync(gen, optimizer):
    """The default config (fused_step="auto") with torch's AdamW / SGD or FusedAdamW: the stats say the fused
    tail ran, and a whole window, its end included, runs under sync_debug_mode("error"). The first window
    runs in the default mode: it creates the optimizer's lazy state (torch.tensor step counts: a host copy)."""
    require_ext("cuda")
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)).cuda()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    config = GradientAccumulationConfig(accumulation_steps=4, max_grad_norm=1.0)
    acc = GradientAccumulator(model, OPTIMIZERS[optimizer](model.parameters()), config)
    batches = [(torch.randn(16, 64, generator=gen).cuda(), torch.randn(16, 8, generator=gen).cuda()) for _ in range(8)]
    before = []
    for i, (x, y) in enumerate(batches):
        if i == 4:  # the second window, under "error"
            before = [p.detach().clone() for p in model.parameters()]
            torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if i >= 4 else "default")
        try:
            with acc.micro_step():
                acc.backward(torch.nn.functional.mse_loss(model(x), y))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    stats = acc.get_accumulation_stats()
    assert stats["fused_step"] is True and stats["fused_step_reason"] == "", stats
    assert acc.optimizer_steps == 2 and acc.skipped_steps == 0
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("tail", TAILS)
def test_window_raises_no_host_sync(gen, tail):
    require_ext("cuda")
    bufs, grads, s = window_inputs(gen)
    opt = tail_state(tail, gen)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        window(bufs, grads, s["inv_scale"], s["found_inf"], s["norm_out"], 1.0, opt)
        gradacc_ext.unscale_(bufs, s["inv_scale"], s["found_inf"])
        gradacc_ext.global_norm(bufs, math.inf, per_tensor=True)
        gradacc_ext.clip_by_value_(bufs, 0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


HUGE = 2**31 + 4099  # elements: int32 offsets overflow past 2**31


def _samples(n: int, gen: torch.Generator) -> torch.Tensor:
    """Indices at both ends, across the 2**31 boundary, and random ones."""
    fixed = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**31 + 1, n - 2, n - 1])
    return torch.cat([fixed, torch.randint(0, n, (100_000,), generator=gen)]).cuda()


def test_one_tensor_beyond_2_31_elements_through_every_op(gen):
    require_ext("cuda")
    free, _ = torch.cuda.mem_get_info()
    if free < 24 * 2**30:
        pytest.skip(f"needs 24 GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    g = torch.empty(HUGE, dtype=torch.float16, device="cuda")
    g.normal_(0, 1, generator=torch.Generator("cuda").manual_seed(1))
    idx = _samples(HUGE, gen)

    def sampled(t: torch.Tensor) -> torch.Tensor:
        return t[idx].double()

    def fp16(x: torch.Tensor) -> torch.Tensor:  # the store's rounding (halving a subnormal rounds)
        return x.half().double()

    x0 = sampled(g)
    buf = torch.empty(HUGE, dtype=torch.float16, device="cuda")
    gradacc_ext.accumulate_([buf], [g], 2.0, assign=True)
    assert torch.equal(sampled(buf), fp16(2 * x0))
    found, norm = torch.zeros(1, device="cuda"), torch.zeros((), device="cuda")
    gradacc_ext.accumulate_final_([buf], [g], found, norm, -1.0)  # adds the sum of squares into norm
    assert found.item() == 0.0 and torch.equal(sampled(buf), fp16(x0))  # 2x - x
    want = math.sqrt(sum(c.double().square().sum().item() for c in buf.split(2**28)))
    assert math.isclose(math.sqrt(norm.item()), want, rel_tol=1e-3)
    assert math.isclose(gradacc_ext.global_norm([g]).item(), want, rel_tol=1e-3)
    del buf

    gradacc_ext.clip_by_value_([g], 1.0)
    assert torch.equal(sampled(g), x0.clamp(-1, 1))
    gradacc_ext.clip_by_norm_([g], torch.full((), 4.0, device="cuda"), 1.0, 0.0)
    assert torch.equal(sampled(g), fp16(x0.clamp(-1, 1) / 4))
    g[-1] = math.inf  # the last element: found_inf must see it
    before = sampled(g)
    gradacc_ext.unscale_([g], torch.full((), 2.0, device="cuda"), found)
    assert found.item() == 1.0 and torch.equal(sampled(g), fp16(before * 2))


def test_fused_window_matches_the_oracle(gen):
    """The window itself (what the graph replays) within the oracle's bounds."""
    require_ext("cuda")
    bufs, grads, s = window_inputs(gen)
    g64 = [sum(f64(step)[i] for step in grads) / MICRO_STEPS * 0.5 for i in range(len(NUMELS))]
    window(bufs, grads, s["inv_scale"], s["found_inf"], s["norm_out"], 1e30)  # no clipping
    mag = [sum(f64(step)[i].abs() for step in grads) / MICRO_STEPS * 0.5 for i in range(len(NUMELS))]
    assert_close_list(bufs, g64, mag, 3 * MICRO_STEPS, "window")
    assert_norm_close(s["norm_out"], bufs, 2.0)


def _huge_or_skip(gib: int) -> None:
    require_ext("cuda")
    torch.cuda.empty_cache()  # the previous huge case's blocks back to the device
    free, _ = torch.cuda.mem_get_info()
    if free < gib * 2**30:
        pytest.skip(f"needs {gib} GiB of free GPU memory, {free / 2**30:.1f} GiB free")


def _huge_fp32(count: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator("cuda").manual_seed(seed)
    return [torch.randn(HUGE, device="cuda", generator=g) for _ in range(count)]


@pytest.mark.parametrize("op", ["adamw", "sgd"])
def test_optimizer_step_on_one_tensor_beyond_2_31_elements(gen, op):
    """One fused step over an fp32 param, grad and state of 2**31 + 4099 elements each (34 GB for AdamW), with
    device lr / grad_mult / found_inf: the sampled elements, across the 2**31 boundary, match the reference's
    step of the same elements (in fp32 "nearest" mode an element's result does not depend on its position)."""
    _huge_or_skip(36 if op == "adamw" else 28)
    big = StepInputs(*([t] for t in _huge_fp32(3, seed=3)))  # params, grads, exp_avgs (SGD: momentum buffers)
    if op == "adamw":
        big.exp_avg_sqs = [_huge_fp32(1, seed=4)[0].square_()]
    big.steps = [torch.full((), 5.0, device="cuda")]
    idx = _samples(HUGE, gen)
    small = StepInputs(*([t[idx] for t in group] for group in big.lists()), [big.steps[0].clone()])
    scalars = dict(lr=torch.full((), 1e-2, device="cuda"), grad_mult=torch.full((), 0.5, device="cuda"),
                   found_inf=torch.zeros(1, device="cuda"))  # fmt: skip
    for x, backend in ((big, "ext"), (small, "torch")):
        if op == "adamw":
            adamw_step_(x.params, x.grads, x.exp_avgs, x.exp_avg_sqs, x.steps, weight_decay=0.1, backend=backend,
                        **scalars)  # fmt: skip
        else:
            sgd_step_(x.params, x.grads, momentum=0.9, weight_decay=0.01, momentum_buffers=x.exp_avgs,
                      steps=x.steps, backend=backend, **scalars)  # fmt: skip
    for got, want in zip(big.all_tensors(), small.all_tensors(), strict=True):
        torch.testing.assert_close(got[idx] if got.numel() == HUGE else got, want)
    assert float(big.steps[0]) == 6.0
