"""Issue 23's op traps: outputs sharing memory, autograd leaves as outputs, accumulate_final_'s norm order.

Aliased or overlapping outputs within one call race in the parallel kernels (CPU chunks, CUDA
blocks) and are applied twice in order by the reference: both backends refuse them, word for word
alike, writing nothing. A leaf that requires grad (grad mode on) is refused alike too. Runs on 2
CPU threads, where the race showed.
"""

from __future__ import annotations

import math

import pytest
import torch
from _devices import require_ext
from _oracle import assert_bits_unchanged, assert_raise_alike, cpu_threads, rand, snapshot

import gradacc_ext
from gradacc_ext import ops

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
SHARED = r"share memory \(the same tensor, or overlapping views of one storage\)"
LEAF = r"is a leaf tensor that requires grad, which this op writes in place"


@pytest.fixture(autouse=True)
def two_threads():
    with cpu_threads(2):
        yield


def backends(device: str) -> list[str]:
    require_ext(device)
    return ["ext", "torch"]


# Each case: (inputs(device, gen) -> dict of lists and scalars, call(inputs, backend), the names in the message).
def _lists(device, gen, n=3, dtype=F32):
    return [rand(257 + 64 * i, dtype, device, gen) for i in range(n)]


def twice(device, gen):
    bufs = _lists(device, gen)
    return {"bufs": [bufs[0], bufs[1], bufs[0]], "grads": _lists(device, gen, dtype=BF16)}


def overlapping_views(device, gen):
    storage = rand(1000, F32, device, gen)
    return {"bufs": [storage[:300], rand(40, F32, device, gen), storage[299:600]], "grads": _lists(device, gen)}


def _final(a, be):
    found, norm = torch.zeros((), device=a["bufs"][0].device), torch.zeros((), device=a["bufs"][0].device)
    a["scalars"] = [found, norm]
    gradacc_ext.accumulate_final_(a["bufs"], a["grads"], found, norm, 0.5, backend=be)


def _adamw(a, be):
    p = a["bufs"]
    state = [[torch.zeros_like(t) for t in p] for _ in range(2)]
    exp_avgs = [state[0][0], p[1], state[0][2]] if a.get("param_is_state") else state[0]
    steps = [torch.zeros((), device=p[0].device) for _ in p]
    a["scalars"] = [*state[0], *state[1], *steps]
    grads = [g.float() for g in a["grads"]]
    ops.adamw_step_(p, grads, exp_avgs, state[1], steps, lr=0.1, backend=be)


def _sgd(a, be):
    p = a["bufs"]
    momentum = [torch.zeros_like(p[0])] * len(p)  # one buffer for every param: shared memory
    steps = [torch.zeros((), device=p[0].device) for _ in p]
    a["scalars"] = [momentum[0], *steps]
    grads = [g.float() for g in a["grads"]]
    ops.sgd_step_(p, grads, lr=0.1, momentum=0.9, momentum_buffers=momentum, steps=steps, backend=be)


def _scalars(device):
    return torch.full((), 0.5, device=device), torch.zeros((), device=device)


CALLS = {
    "accumulate_": (lambda a, be: gradacc_ext.accumulate_(a["bufs"], a["grads"], 0.5, backend=be), "bufs", "bufs"),
    "accumulate_final_": (_final, "bufs", "bufs"),
    "unscale_": (
        lambda a, be: gradacc_ext.unscale_(a["bufs"], *_scalars(a["bufs"][0].device), backend=be),
        "tensors",
        "tensors",
    ),
    "clip_by_norm_": (lambda a, be: gradacc_ext.clip_by_norm_(a["bufs"], 9.0, 1.0, backend=be), "tensors", "tensors"),
    "clip_by_value_": (lambda a, be: gradacc_ext.clip_by_value_(a["bufs"], 0.1, backend=be), "tensors", "tensors"),
    "clip_grad_norm_": (lambda a, be: gradacc_ext.clip_grad_norm_(a["bufs"], 0.1, backend=be), "tensors", "tensors"),
    "adamw_step_": (_adamw, "params", "params"),
}


@pytest.mark.parametrize("layout", [twice, overlapping_views], ids=["listed-twice", "overlapping-views"])
@pytest.mark.parametrize("op", list(CALLS))
def test_outputs_sharing_memory_are_refused_alike_and_nothing_is_written(device, gen, op, layout):
    call, first, second = CALLS[op]
    runs = []
    for be in backends(device):
        inputs = layout(device, torch.Generator().manual_seed(int(gen.initial_seed())))
        watched = [*inputs["bufs"], *inputs["grads"]]

        def run(inputs=inputs, be=be, watched=watched):
            before = snapshot(watched)
            try:
                call(inputs, be)
            finally:
                assert_bits_unchanged(before, watched, f"{op} {be}")

        runs.append(run)
    assert_raise_alike(runs, ValueError, rf"gradacc\.{op}: {first}\[0\] and {second}\[2\] {SHARED}")


def test_an_output_shared_across_lists_is_refused(device, gen):
    """adamw_step_'s params[1] is also its exp_avgs[1]; sgd_step_'s momentum buffer is listed for every param."""
    cases = ((_adamw, r"params\[1\] and exp_avgs\[1\]"), (_sgd, r"momentum_buffers\[0\] and momentum_buffers\[1\]"))
    for call, match in cases:
        runs = []
        for be in backends(device):
            inputs = {"bufs": _lists(device, gen), "grads": _lists(device, gen), "param_is_state": True}
            runs.append(lambda inputs=inputs, be=be, call=call: call(inputs, be))
        assert_raise_alike(runs, ValueError, match + " " + SHARED)


def test_adjacent_views_of_one_storage_are_fine_and_match_separate_tensors(device, gen):
    storage = rand(1000, F32, device, gen)
    grads = [rand(500, BF16, device, gen), rand(500, BF16, device, gen)]
    separate = [storage[:500].clone(), storage[500:].clone()]
    for be in backends(device):
        base, twins = storage.clone(), [t.clone() for t in separate]
        views = [base[:500], base[500:]]  # adjacent: they touch, they do not overlap
        gradacc_ext.accumulate_(views, grads, 0.5, backend=be)
        gradacc_ext.accumulate_(twins, grads, 0.5, backend=be)
        for got, want in zip(views, twins, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_race_case_is_refused_on_two_threads(device, gen):
    """The probe's case: accumulate_([b, b], [g, g]) over 4M elements, which raced on 2 threads."""
    b, g = rand(1 << 22, F32, device, gen), rand(1 << 22, F32, device, gen)
    before = snapshot([b])
    runs = [lambda be=be: gradacc_ext.accumulate_([b, b], [g, g], backend=be) for be in backends(device)]
    assert_raise_alike(runs, ValueError, rf"bufs\[0\] and bufs\[1\] {SHARED}")
    assert_bits_unchanged(before, [b], "bufs")


LEAF_CALLS = {
    "accumulate_": lambda t, g, be: gradacc_ext.accumulate_([t], [g], backend=be),
    "unscale_": lambda t, g, be: gradacc_ext.unscale_([t], *_scalars(t.device), backend=be),
    "clip_by_value_": lambda t, g, be: gradacc_ext.clip_by_value_([t], 0.1, backend=be),
    "clip_grad_norm_": lambda t, g, be: gradacc_ext.clip_grad_norm_([t], 0.1, backend=be),
}


@pytest.mark.parametrize("op", list(LEAF_CALLS))
def test_a_leaf_that_requires_grad_is_refused_alike_in_grad_mode_and_written_under_no_grad(device, gen, op):
    call = LEAF_CALLS[op]
    leaf = rand(300, F32, device, gen).requires_grad_()
    grad = rand(300, F32, device, gen)
    before = snapshot([leaf.detach()])
    runs = [lambda be=be: call(leaf, grad, be) for be in backends(device)]
    arg = "bufs" if op == "accumulate_" else "tensors"
    assert_raise_alike(runs, RuntimeError, rf"gradacc\.{op}: {arg}\[0\] {LEAF}")
    assert_bits_unchanged(before, [leaf.detach()], "the leaf")
    results = []
    for be in backends(device):
        twin = leaf.detach().clone().requires_grad_()
        with torch.no_grad():
            call(twin, grad, be)
        results.append(twin.detach())
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-6)
    assert not torch.equal(results[0], leaf.detach())  # written


# ---- accumulate_final_'s partials add for norm types 2 and inf only --------------------------------------------

REFUSED_ORDERS = [1.0, 3.0, 0.5, 0.0, -math.inf, math.nan]


@pytest.mark.parametrize("norm_type", REFUSED_ORDERS, ids=[f"p{p:g}" for p in REFUSED_ORDERS])
def test_accumulate_final_refuses_an_order_without_partials_alike(device, gen, norm_type):
    """A last fold's buckets add sums of squares or maxima; no other order adds across calls, and both
    backends refuse it word for word, before anything is written."""
    bufs, grads = [rand(10, F32, device, gen)], [rand(10, F32, device, gen)]
    found, norm = torch.zeros((), device=device), torch.zeros((), device=device)
    before = snapshot([*bufs, found, norm])
    runs = [lambda be=be: ops.accumulate_final_(bufs, grads, found, norm, norm_type=norm_type, backend=be)
            for be in backends(device)]  # fmt: skip
    assert_raise_alike(runs, ValueError, "norm_type must be 2.0 or inf")
    assert_bits_unchanged(before, [*bufs, found, norm])
