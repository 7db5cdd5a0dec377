"""GPU-only checks of scripts/gpu_verify.sh (all skip without CUDA): a whole accumulation window
captured in a CUDA graph, a window under torch.cuda.set_sync_debug_mode("error"), and one tensor of
more than 2**31 elements through every op."""

from __future__ import annotations

import math

import pytest
import torch
from _oracle import assert_close_list, assert_norm_close, f64, rand_list
from conftest import CUDA_SKIP, require_ext

import gradacc_ext

pytestmark = CUDA_SKIP
MICRO_STEPS = 4
NUMELS = [1, 7, 65535, 65537, 300_001, 4099]  # odd sizes, several chunks


def window(bufs, grads_per_step, inv_scale, found_inf, norm_out, max_norm) -> None:
    """One accumulation window as GradientAccumulator runs it: assign, accumulate, final step, clip."""
    last = len(grads_per_step) - 1
    for k, grads in enumerate(grads_per_step[:last]):
        gradacc_ext.accumulate_(bufs, grads, 1.0 / (last + 1), assign=k == 0)
    gradacc_ext.accumulate_final_(bufs, grads_per_step[last], found_inf, norm_out, 1.0 / (last + 1),
                                  inv_scale=inv_scale)  # fmt: skip
    gradacc_ext.clip_by_norm_(bufs, norm_out, max_norm)


def window_inputs(gen):
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.bfloat16, torch.float16, torch.float32]
    grads = [rand_list(NUMELS, dtypes, "cuda", gen) for _ in range(MICRO_STEPS)]
    bufs = rand_list(NUMELS, torch.float32, "cuda", gen)
    scalars = dict(inv_scale=torch.full((), 0.5, device="cuda"), found_inf=torch.zeros(1, device="cuda"),
                   norm_out=torch.zeros((), device="cuda"))  # fmt: skip
    return bufs, grads, scalars


def test_cuda_graph_captures_a_whole_window(gen):
    require_ext("cuda")
    bufs, grads, s = window_inputs(gen)
    eager_bufs = [b.clone() for b in bufs]
    eager = {k: v.clone() for k, v in s.items()}
    window(eager_bufs, grads, eager["inv_scale"], eager["found_inf"], eager["norm_out"], 1.0)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (workspace allocations)
        window([b.clone() for b in bufs], grads, s["inv_scale"], s["found_inf"].clone(), s["norm_out"].clone(), 1.0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        window(bufs, grads, s["inv_scale"], s["found_inf"], s["norm_out"], 1.0)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(bufs, eager_bufs, strict=True):
        assert torch.equal(got, want)  # same kernels, same order: bitwise
    assert torch.equal(s["norm_out"], eager["norm_out"]) and torch.equal(s["found_inf"], eager["found_inf"])


def test_window_raises_no_host_sync(gen):
    require_ext("cuda")
    bufs, grads, s = window_inputs(gen)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        window(bufs, grads, s["inv_scale"], s["found_inf"], s["norm_out"], 1.0)
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
    gradacc_ext.accumulate_final_([buf], [g], found, norm, -1.0, inv_scale=torch.full((), 0.5, device="cuda"))
    assert found.item() == 0.0 and torch.equal(sampled(buf), fp16(0.5 * x0))  # (2x - x) / 2
    want = math.sqrt(sum(c.double().square().sum().item() for c in buf.split(2**28)))
    assert math.isclose(norm.item(), want, rel_tol=1e-3)
    assert math.isclose(gradacc_ext.global_norm([g]).item(), 2 * want, rel_tol=1e-3)
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
