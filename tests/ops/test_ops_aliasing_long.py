"""The overlap check on long lists (csrc/aliasing.cpp sort_ranges): from 256 outputs out of address order the
compiled check sorts by a radix sort of the starts, not std::sort. Its verdict and the pair it names must stay
the Python check's (ops/_aliasing.py) for every order a list comes in: shuffled, descending (the grads backward
made), in a few ascending runs, and with two outputs at one start (the ties the radix sort leaves to `before`)."""

from __future__ import annotations

import re

import pytest
import torch
from _devices import require_ext
from _oracle import rand

from gradacc_ext import ops

F32 = torch.float32
SHARED = r"share memory \(the same tensor, or overlapping views of one storage\)"
N = 600  # past the radix sort's threshold (256)
ORDERS = ("shuffled", "descending", "runs")


def _order(kind: str, n: int, rng: torch.Generator) -> list[int]:
    if kind == "shuffled":
        return torch.randperm(n, generator=rng).tolist()
    if kind == "descending":
        return list(range(n - 1, -1, -1))
    cuts = sorted(torch.randperm(n - 1, generator=rng)[:5].add(1).tolist())  # six ascending runs, in turn
    runs = [list(range(a, b)) for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    return [i for run in reversed(runs) for i in run]


def _layout(kind: str, rng: torch.Generator) -> tuple[list[tuple[int, int]], int]:
    """N disjoint slots of 1-9 elements with gaps, in `kind` order; and the storage's length."""
    lengths = torch.randint(1, 10, (N,), generator=rng).tolist()
    starts = [sum(lengths[:i]) + 3 * i for i in range(N)]
    slots = [(starts[i], starts[i] + lengths[i]) for i in _order(kind, N, rng)]
    return slots, starts[-1] + lengths[-1]


def _messages(bufs: list[tuple[int, int]], grads: list[tuple[int, int]], storage: torch.Tensor) -> list:
    """What the compiled op itself (torch.ops.gradacc, no Python re-check: the public op would re-raise the
    Python check's message) and the reference say of accumulate_ over these views, None for no error; the
    storage is left untouched by a refusal."""
    out = []
    for call, error in ((torch.ops.gradacc.accumulate_, RuntimeError), (ops.accumulate_, ValueError)):
        work = storage.clone()
        views = [work[a:b] for a, b in bufs], [work[a:b] for a, b in grads]
        try:
            call(*views, 0.5, None, False) if error is RuntimeError else call(*views, 0.5, backend="torch")
            out.append(None)
        except error as exc:
            assert re.search(SHARED, str(exc)), exc
            assert torch.equal(work, storage), "written before the refusal"
            out.append(re.search(r"bufs\[\d+\] and \w+\[\d+\] share memory", str(exc)).group(0))
    return out


@pytest.mark.parametrize("kind", ORDERS)
def test_disjoint_long_lists_in_any_order_are_accepted_and_accumulated(device, gen, kind):
    require_ext(device)
    rng = torch.Generator().manual_seed(int(gen.initial_seed()))
    slots, length = _layout(kind, rng)
    storage = rand(length, F32, device, gen)
    grads = [rand(b - a, F32, device, gen) for a, b in slots]
    want = storage.double().clone()
    for (a, b), g in zip(slots, grads, strict=True):
        want[a:b] += 0.5 * g.double()
    ops.accumulate_([storage[a:b] for a, b in slots], grads, 0.5, backend="ext")
    torch.testing.assert_close(storage.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tie", [False, True], ids=["overlap", "same-start"])
@pytest.mark.parametrize("kind", ORDERS)
def test_one_overlap_in_a_long_list_is_named_as_the_python_check_names_it(device, gen, kind, tie):
    """Two outputs made to overlap (or to start at one address, one longer), anywhere in the list; and a grad
    that reaches into another pair's output: refused alike on both backends, nothing written."""
    require_ext(device)
    rng = torch.Generator().manual_seed(int(gen.initial_seed()))
    slots, length = _layout(kind, rng)
    storage = rand(length + 16, F32, device, gen)
    i, j = torch.randperm(N, generator=rng)[:2].tolist()
    a, b = slots[i]
    bufs = list(slots)
    bufs[j] = (a, b + 1) if tie else (a + (b - a) // 2, b + 2)  # j now shares slot i's memory
    grads = [(length + 8 - (e - s), length + 8) if k == j else (s, e) for k, (s, e) in enumerate(bufs)]
    messages = _messages(bufs, grads, storage)
    assert messages[0] is not None and messages[0] == messages[1], messages
    # outputs disjoint, one grad reaching into another pair's output
    grads = list(slots)
    grads[j] = (a, a + slots[j][1] - slots[j][0])
    messages = _messages(slots, grads, storage)
    assert messages[0] is not None and messages[0] == messages[1], messages


@pytest.mark.parametrize("kind", ORDERS)
def test_three_outputs_at_one_start_are_named_by_their_ends_as_the_python_check_does(device, gen, kind):
    """Outputs p < q < r at one address, p the longest and r the shortest: sorted by (start, end, argument,
    index), r and q meet first, so both backends name bufs[q] and bufs[r] (not the first two by index)."""
    require_ext(device)
    rng = torch.Generator().manual_seed(int(gen.initial_seed()))
    slots, length = _layout(kind, rng)
    storage = rand(length + 16, F32, device, gen)
    p, q, r = sorted(torch.randperm(N, generator=rng)[:3].tolist())
    at = slots[p][0]
    bufs = list(slots)
    bufs[p], bufs[q], bufs[r] = (at, at + 12), (at, at + 11), (at, at + 10)
    grads = [(length + 14 - (e - s), length + 14) if k in (p, q, r) else (s, e) for k, (s, e) in enumerate(bufs)]
    messages = _messages(bufs, grads, storage)
    assert messages[0] == messages[1], messages
    assert messages[0] == f"bufs[{q}] and bufs[{r}] share memory", messages


def test_separate_allocations_in_shuffled_order_take_several_radix_passes(device, gen):
    """Tensors of their own (addresses over many bits): a planted duplicate is found, a clean list passes."""
    require_ext(device)
    rng = torch.Generator().manual_seed(int(gen.initial_seed()))
    bufs = [rand(int(torch.randint(1, 40, (1,), generator=rng)), F32, device, gen) for _ in range(N)]
    order = torch.randperm(N, generator=rng).tolist()
    bufs = [bufs[i] for i in order]
    grads = [rand(b.numel(), F32, device, gen) for b in bufs]
    want = [b.double() + 2.0 * g.double() for b, g in zip(bufs, grads, strict=True)]
    ops.accumulate_(bufs, grads, 2.0, backend="ext")
    for got, exp in zip(bufs, want, strict=True):
        torch.testing.assert_close(got.double(), exp, rtol=1e-6, atol=1e-6)
    i, j = sorted(torch.randperm(N, generator=rng)[:2].tolist())
    twice = list(bufs)
    twice[j] = bufs[i]
    grads[j] = rand(bufs[i].numel(), F32, device, gen)
    with pytest.raises(ValueError, match=rf"bufs\[{i}\] and bufs\[{j}\] " + SHARED):
        ops.accumulate_(twice, grads, 2.0, backend="ext")
