"""Issue 27 finding 6: an op's input may not share memory with an output (ops/_aliasing.py, csrc/aliasing.h).

accumulate_([a, b], [b, a]) raced in the C++ kernels (a different result on most runs with 2 threads) while the
reference applied the pairs in order. Each op with lists now compares every output with every input as well as
with the other outputs, on both backends, with one message naming the pair, before anything is written. Inputs
may share memory with each other (they are only read), and accumulate_ / accumulate_final_ take grads[i] that is
exactly bufs[i] (elementwise in place); the optimizer steps take no such pair.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from _devices import require_ext
from _oracle import assert_bits_unchanged, assert_raise_alike, cpu_threads, rand, snapshot

from gradacc_ext import ops

F32 = torch.float32
SHARED = r"share memory \(the same tensor, or overlapping views of one storage\)"


@pytest.fixture(autouse=True)
def two_threads():
    with cpu_threads(2):
        yield


def _zeros(device: str) -> torch.Tensor:
    return torch.zeros((), device=device)


# Each case: make(device, gen) -> (the tensors to watch, call(backend)); the op raises on each backend.
Made = tuple[list[torch.Tensor], Callable[[str], object]]


def _swapped(device, gen, final=False) -> Made:
    """The issue's case: each item's grad is the other item's buffer."""
    a, b = rand(4096, F32, device, gen), rand(4096, F32, device, gen)
    if final:
        return [a, b], lambda be: ops.accumulate_final_([a, b], [b, a], _zeros(device), _zeros(device), backend=be)
    return [a, b], lambda be: ops.accumulate_([a, b], [b, a], 0.5, backend=be)


def _overlapping_pair(device, gen) -> Made:
    """grads[0] is a view overlapping bufs[0] without being it."""
    storage = rand(700, F32, device, gen)
    return [storage], lambda be: ops.accumulate_([storage[:300]], [storage[100:400]], 0.5, backend=be)


def _alpha_in_a_buffer(device, gen) -> Made:
    bufs, grads = ([rand(300, F32, device, gen) for _ in range(2)] for _ in range(2))
    return bufs, lambda be: ops.accumulate_(bufs, grads, bufs[1][7:8], backend=be)


def _found_inf_in_a_buffer(device, gen) -> Made:
    bufs, grads = ([rand(300, F32, device, gen) for _ in range(2)] for _ in range(2))
    return bufs, lambda be: ops.accumulate_final_(bufs, grads, bufs[1][3:4], _zeros(device), 0.5, backend=be)


def _unscale_flag_is_scale(device, gen) -> Made:
    tensors, flag = [rand(300, F32, device, gen)], torch.ones(1, device=device)
    return [*tensors, flag], lambda be: ops.unscale_(tensors, flag, flag, backend=be)


def _clip_norm_in_a_tensor(device, gen) -> Made:
    tensors = [rand(300, F32, device, gen) for _ in range(2)]
    return tensors, lambda be: ops.clip_by_norm_(tensors, tensors[0][:1], 0.5, backend=be)


def _adam(device, gen, grads_of: Callable[[list, list], list]) -> Made:
    params = [rand(200, F32, device, gen) for _ in range(3)]
    exp_avgs, exp_avg_sqs = ([rand(200, F32, device, gen).abs() for _ in range(3)] for _ in range(2))
    steps = [_zeros(device) for _ in range(3)]
    grads = grads_of(params, exp_avgs)

    def call(be: str) -> None:
        ops.adamw_step_(params, grads, exp_avgs, exp_avg_sqs, steps, lr=0.1, backend=be)

    return [*params, *exp_avgs, *exp_avg_sqs, *steps], call


def _sgd_grad_mult_in_a_param(device, gen) -> Made:
    params, grads = ([rand(200, F32, device, gen) for _ in range(2)] for _ in range(2))
    return params, lambda be: ops.sgd_step_(params, grads, lr=0.1, grad_mult=params[1][5:6], backend=be)


def _lion_grad_is_another_state(device, gen) -> Made:
    params, exp_avgs = ([rand(200, F32, device, gen) for _ in range(2)] for _ in range(2))
    grads = [rand(200, F32, device, gen), exp_avgs[0]]
    return [*params, *exp_avgs], lambda be: ops.lion_step_(params, grads, exp_avgs, lr=0.1, backend=be)


CASES: dict[str, tuple[Callable[[str, torch.Generator], Made], str]] = {
    "accumulate_-swapped": (_swapped, r"gradacc\.accumulate_: bufs\[1\] and grads\[0\]"),
    "accumulate_final_-swapped": (
        lambda d, g: _swapped(d, g, final=True),
        r"gradacc\.accumulate_final_: bufs\[1\] and grads\[0\]",
    ),
    "accumulate_-overlapping-own-pair": (_overlapping_pair, r"bufs\[0\] and grads\[0\]"),
    "accumulate_-alpha_tensor": (_alpha_in_a_buffer, r"bufs\[1\] and alpha_tensor"),
    "accumulate_final_-found_inf": (_found_inf_in_a_buffer, r"bufs\[1\] and found_inf"),
    "unscale_-inv_scale-is-found_inf": (_unscale_flag_is_scale, r"found_inf and inv_scale"),
    "clip_by_norm_-total_norm": (_clip_norm_in_a_tensor, r"tensors\[0\] and total_norm"),
    "adamw_step_-grad-is-its-param": (
        lambda d, g: _adam(d, g, lambda p, m: list(p)),
        r"gradacc\.adamw_step_: params\[0\] and grads\[0\]",
    ),
    "adamw_step_-grad-is-another-state": (
        lambda d, g: _adam(d, g, lambda p, m: [m[1], torch.randn_like(p[1]), torch.randn_like(p[2])]),
        r"exp_avgs\[1\] and grads\[0\]",
    ),
    "sgd_step_-grad_mult": (_sgd_grad_mult_in_a_param, r"params\[1\] and grad_mult"),
    "lion_step_-grad-is-another-state": (_lion_grad_is_another_state, r"exp_avgs\[0\] and grads\[1\]"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_input_sharing_memory_with_an_output_is_refused_alike_and_nothing_is_written(device, gen, case):
    require_ext(device)
    make, match = CASES[case]
    seed = int(gen.initial_seed())
    runs = []
    for be in ("ext", "torch"):
        watched, call = make(device, torch.Generator().manual_seed(seed))

        def run(be=be, watched=watched, call=call):
            before = snapshot(watched)
            try:
                with torch.no_grad():
                    call(be)
            finally:
                assert_bits_unchanged(before, watched, f"{case} {be}")

        runs.append(run)
    assert_raise_alike(runs, ValueError, f"{match} {SHARED}")


def test_the_compiled_op_names_the_pair_in_the_message_of_the_python_check(device, gen):
    """One message: torch.ops.gradacc.accumulate_ itself (no Python re-check) says what the public op says."""
    require_ext(device)
    a, b = rand(64, F32, device, gen), rand(64, F32, device, gen)
    with pytest.raises(ValueError) as public:
        ops.accumulate_([a, b], [b, a], 0.5)
    with pytest.raises(RuntimeError) as raw:
        torch.ops.gradacc.accumulate_([a, b], [b, a], 0.5, None, False)
    assert str(public.value) in str(raw.value)


@pytest.mark.parametrize("final", [False, True], ids=["accumulate_", "accumulate_final_"])
def test_a_grad_that_is_its_own_buffer_is_accumulated_in_place(device, backend, gen, final):
    """bufs[i] += alpha * bufs[i]: the in-place pair both accumulate ops define, equal to the float64 result."""
    bufs = [rand(n, F32, device, gen) for n in (5, 1031, 64)]
    other = rand(64, F32, device, gen)
    grads = [bufs[0], bufs[1], other]
    want = [b.double() * 1.5 for b in bufs[:2]] + [bufs[2].double() + 0.5 * other.double()]
    if final:
        found, norm = _zeros(device), _zeros(device)
        ops.accumulate_final_(bufs, grads, found, norm, 0.5, backend=backend)
        assert found.item() == 0.0
    else:
        ops.accumulate_(bufs, grads, 0.5, backend=backend)
    for got, exp in zip(bufs, want, strict=True):
        torch.testing.assert_close(got.double(), exp, rtol=1e-6, atol=1e-6)


def test_inputs_may_share_memory_with_each_other(device, backend, gen):
    """Inputs are only read: one gradient for two buffers, and a scale inside a gradient, are fine."""
    bufs = [rand(300, F32, device, gen) for _ in range(2)]
    grad = rand(300, F32, device, gen)
    want = [b.double() + grad[4].double() * grad.double() for b in bufs]
    ops.accumulate_(bufs, [grad, grad], grad[4:5], backend=backend)
    for got, exp in zip(bufs, want, strict=True):
        torch.testing.assert_close(got.double(), exp, rtol=1e-6, atol=1e-6)


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_the_check_refuses_exactly_the_overlapping_calls_of_random_layouts(device, gen):
    """Against a brute-force O(n^2) oracle: random views of one storage as bufs and grads (in address order or
    shuffled, so both the sorted and the sorting path run, and grads inside and outside the outputs' hull).
    A call is refused exactly when an output overlaps another output or an input other than its own identical
    pair, and both backends then raise the same message."""
    require_ext(device)
    storage = rand(400, F32, device, gen)
    rng = torch.Generator().manual_seed(int(gen.initial_seed()))
    refused = accepted = 0
    for _ in range(150):
        n = int(torch.randint(1, 5, (1,), generator=rng))
        lengths = torch.randint(1, 12, (n,), generator=rng).tolist()
        buf_at = torch.randint(0, 300, (n,), generator=rng).tolist()
        if bool(torch.rand(1, generator=rng) < 0.5):  # accumulator-like: in address order, apart
            buf_at = [sum(lengths[:i]) + 4 * i for i in range(n)]
        grad_at = [b if bool(torch.rand(1, generator=rng) < 0.3) else int(torch.randint(0, 390, (1,), generator=rng))
                   for b in buf_at]  # fmt: skip
        bufs = [(a, a + k) for a, k in zip(buf_at, lengths, strict=True)]
        grads = [(a, min(a + k, 400)) for a, k in zip(grad_at, lengths, strict=True)]
        if any(g[1] - g[0] != b[1] - b[0] for b, g in zip(bufs, grads, strict=True)):
            continue  # a shape mismatch is another check's
        bad = any(_overlaps(bufs[i], bufs[j]) for i in range(n) for j in range(i + 1, n)) or any(
            _overlaps(bufs[i], grads[j]) and not (i == j and bufs[i] == grads[j]) for i in range(n) for j in range(n)
        )
        messages = []
        for be in ("ext", "torch"):
            work = storage.clone()
            try:
                ops.accumulate_([work[a:b] for a, b in bufs], [work[a:b] for a, b in grads], 0.5, backend=be)
                messages.append(None)
            except ValueError as exc:
                assert re.search(SHARED, str(exc)), exc
                messages.append(str(exc))
        assert (messages[0] is not None) == bad, (bufs, grads, messages)
        assert messages[0] == messages[1], (bufs, grads, messages)
        refused, accepted = refused + bad, accepted + (not bad)
    assert refused > 10 and accepted > 10, (refused, accepted)  # both outcomes were exercised
