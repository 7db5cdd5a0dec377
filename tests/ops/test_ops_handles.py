"""The compiled ops own the tensor handles the dispatcher hands them (csrc/boxing.h's TensorList) and must
release every one when the call ends, whether it returns or throws: a handle kept alive keeps a C++
reference, which torch turns into a reference to the tensor's Python object (seen by sys.getrefcount)."""

from __future__ import annotations

import sys

import pytest
import torch
from _devices import require_ext


def refcounts(tensors: list[torch.Tensor]) -> list[int]:
    return [sys.getrefcount(t) for t in tensors]


def calls(device: str, gen: torch.Generator) -> dict:
    """One raw call per kind of kernel: Tensor[] lists, optional and plain tensors, outputs, a boxed step."""
    t = {k: [torch.randn(5, generator=gen).to(device) for _ in range(3)] for k in ("a", "b", "p", "g", "m")}
    one, zero = torch.ones(1, device=device), torch.zeros(1, device=device)
    steps = [torch.zeros((), device=device) for _ in range(3)]
    ops = torch.ops.gradacc
    return {
        "accumulate_": (lambda: ops.accumulate_(t["a"], t["b"], 0.5, one, False), t["a"] + t["b"] + [one]),
        "unscale_": (lambda: ops.unscale_(t["a"], one, zero), t["a"] + [one, zero]),
        "global_norm": (lambda: ops.global_norm(t["a"], 2.0, True), t["a"]),
        "clip_by_value_": (lambda: ops.clip_by_value_(t["a"], 1.0), t["a"]),
        "sgd_step_": (
            lambda: ops.sgd_step_(t["p"], t["g"], t["m"], [], [], steps, 0.1, None, None, zero, 0.9, 0.0, 0.0, False,
                                  False, 0, 0),
            t["p"] + t["g"] + t["m"] + steps + [zero],
        ),
    }  # fmt: skip


@pytest.mark.parametrize("op", ["accumulate_", "unscale_", "global_norm", "clip_by_value_", "sgd_step_"])
@pytest.mark.parametrize("fails", [False, True], ids=["returns", "throws"])
def test_every_handle_is_released(device, gen, op, fails):
    require_ext(device)
    call, tensors = calls(device, gen)[op]
    if fails:  # the first list's last item breaks a check; every argument was unboxed by then
        tensors[2].data = torch.randn(10, generator=gen).to(device)[::2]  # neither contiguous nor dense
    before = refcounts(tensors)
    for _ in range(3):
        if fails:
            with pytest.raises(RuntimeError, match="not contiguous|not dense"):
                call()
        else:
            call()
    assert refcounts(tensors) == before


@pytest.mark.parametrize("op", ["accumulate_", "unscale_"])
def test_handles_released_from_python_threads(gen, op):
    """The handles are deleted under one GIL hold taken by the op (csrc/handles.h): from several Python threads
    at once, each call still releases its tensors, and a tensor the call's list alone kept alive dies with it."""
    import threading
    import weakref

    require_ext("cpu")
    call, tensors = calls("cpu", gen)[op]
    before = refcounts(tensors)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for _ in range(50):
                call()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert refcounts(tensors) == before
    temps = [torch.randn(4, generator=gen) for _ in range(3)]
    ref = weakref.ref(temps[1])
    torch.ops.gradacc.unscale_(temps, torch.ones(1), torch.zeros(1))
    del temps
    assert ref() is None


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")  # the way onto a thread without Python
def test_handles_released_from_a_thread_without_python(gen):
    """torch.jit.fork runs the op on torch's inter-op pool, a thread with no Python thread state: there the
    handles are deleted one by one, as torch does, without the GIL hold (csrc/handles.h)."""
    require_ext("cpu")
    fold = torch.jit.script(_fold)
    bufs, grads = [torch.zeros(4) for _ in range(3)], [torch.randn(4, generator=gen) for _ in range(3)]
    before = refcounts(bufs + grads)
    for _ in range(5):
        torch.jit.wait(torch.jit.fork(fold, bufs, grads))
    assert refcounts(bufs + grads) == before
    for b, g in zip(bufs, grads, strict=True):
        torch.testing.assert_close(b.double(), 5 * g.double(), rtol=1e-6, atol=1e-6)


def _fold(bufs: list[torch.Tensor], grads: list[torch.Tensor]) -> int:
    torch.ops.gradacc.accumulate_(bufs, grads, 1.0, None, False)
    return 0
