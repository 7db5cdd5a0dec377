"""Issue 9: gradients folded into the buffers during backward, in buckets; what is held when; hook ownership.

Float64 models (the accumulator then runs the reference ops in float64, so
tolerances are ~1e-12) against a plain loop that accumulates loss / n into
.grad; fresh random data in every test. Small buckets make every backward
fold several times while it runs.
"""

from __future__ import annotations

import copy
import gc
import math

import pytest
import torch
import torch.nn.functional as F
from _cases import IN, OUT, FailInBackward, assert_params_close, make_batches, make_model, mse
from torch.profiler import ProfilerActivity, profile

from gradacc_ext.accumulate.accumulator import GradientAccumulator
from gradacc_ext.accumulate.buffers import ALIGN
from gradacc_ext.accumulate.checkpoint import STATE_VERSION
from gradacc_ext.accumulate.config import GradientAccumulationConfig
from gradacc_ext.benchmarking.memory import allocated_bytes
from gradacc_ext.ops import reference

F64 = torch.float64


def plain_loop(model, batches, n, loss_fn=mse, lr=0.1):
    """SGD over windows of n micro-batches, each backward adding loss / k into .grad (k: the window's size)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    norms = []
    for start in range(0, len(batches), n):
        window = batches[start : start + n]
        opt.zero_grad(set_to_none=True)
        for batch in window:
            (loss_fn(model, batch) / len(window)).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
        opt.step()
    return norms


def run(acc, batches, loss_fn=mse):
    for batch in batches:
        with acc.micro_step():
            acc.backward(loss_fn(acc.module, batch))
    acc.flush()


def hook_count(p: torch.Tensor) -> int:
    return len(p._post_accumulate_grad_hooks or {})


class Tied(torch.nn.Module):
    """The first layer's weight used twice (as in tied embeddings), a frozen layer, an optionally unused branch."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(IN, IN)
        self.frozen = torch.nn.Linear(IN, IN).requires_grad_(False)
        self.b = torch.nn.Linear(IN, OUT)
        self.branch = torch.nn.Linear(IN, OUT)

    def forward(self, x, use_branch=True):
        h = torch.tanh(F.linear(torch.tanh(self.a(x)), self.a.weight)) + self.frozen(x)
        return self.b(h) + (self.branch(x) if use_branch else 0)


@pytest.mark.parametrize("bucket", [1, 200, 25 * 1024 * 1024])
def test_buckets_tied_unused_and_frozen_equal_the_plain_loop(bucket):
    torch.manual_seed(bucket % 97)
    model = Tied().to(F64)
    ref = copy.deepcopy(model)
    batches = [(*b, i % 3 != 1) for i, b in enumerate(make_batches(7, 4, F64, bucket % 89))]

    def loss_fn(m, batch):
        x, y, use = batch
        return F.mse_loss(m(x, use), y)

    config = GradientAccumulationConfig(accumulation_steps=3, bucket_size_bytes=bucket)
    with GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), config) as acc:
        folds = []
        real_add = acc._sums.add
        acc._sums.add = lambda index, grads, scale: (folds.append(len(index)), real_add(index, grads, scale))
        run(acc, batches, loss_fn)
    norms = plain_loop(ref, batches, 3, loss_fn)
    assert_params_close(model, ref, F64)
    # The tied weight's two uses are summed by autograd before its hook fires: counted once in the norm.
    torch.testing.assert_close(acc.grad_norm_history().double(), torch.tensor(norms, dtype=F64), rtol=1e-6, atol=0)
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    if bucket == 1:
        assert max(folds) == 1  # every gradient folded as soon as autograd produced it
    elif bucket > 1 << 20:
        assert len(folds) == 7 and max(folds) == n_params  # one fold per backward, after it
    assert all(p.grad is None for p in model.parameters())


def test_no_gradient_outside_the_buffers_beyond_one_bucket():
    """The deterministic accounting: while backward runs, live gradients outside the buffers stay within one
    bucket plus the gradient that filled it; after each backward none is left."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)]).to(F64)
    params = list(model.parameters())
    bucket = 3000  # bytes: a weight (2048 B) and a bias (128 B) fit, a second weight does not
    config = GradientAccumulationConfig(accumulation_steps=4, bucket_size_bytes=bucket)
    acc = GradientAccumulator(model, torch.optim.SGD(params, lr=0.1), config)
    flats = acc._buffers

    def outside_bytes() -> int:
        held = [g for g in acc._hooks._queue.values()] + [p.grad for p in params if p.grad is not None]
        storage = {f.untyped_storage().data_ptr() for f in flats.flats.values()}
        return sum(g.numel() * g.element_size() for g in held if g.untyped_storage().data_ptr() not in storage)

    seen = []
    probes = [p.register_post_accumulate_grad_hook(lambda p: seen.append(outside_bytes())) for p in params]
    largest = max(p.numel() * p.element_size() for p in params)
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        with acc.micro_step():
            acc.backward(model(torch.randn(3, 16, generator=g, dtype=F64)).square().mean())
        if acc.micro_steps_in_window:
            assert all(p.grad is None for p in params) and outside_bytes() == 0
    assert len(seen) == 4 * len(params) and 0 < max(seen) <= bucket + largest
    for h in probes:
        h.remove()
    acc.close()


def test_every_view_is_aligned_and_buffers_are_in_backward_order():
    sizes = [3, 5, 1, 7, 2, 9]
    params = [torch.nn.Parameter(torch.randn(n, dtype=d)) for n in sizes for d in (torch.bfloat16, torch.float32)]
    params.append(torch.nn.Parameter(torch.randn(3, 3, dtype=F64)[:, 1]))  # a non-contiguous view as a parameter
    for accum in (torch.float32, None):
        config = GradientAccumulationConfig(1, accum_dtype=accum)
        acc = GradientAccumulator(params, torch.optim.SGD(params, lr=0.1), config)
        acc._buffers._ensure()
        views = acc._buffers.views
        assert all(v.data_ptr() % ALIGN == 0 for v in views)
        for dtype in acc._buffers.dtypes:
            starts = [v.data_ptr() for v, d in zip(views, acc._buffers.buf_dtypes, strict=True) if d == dtype]
            assert starts == sorted(starts, reverse=True)  # the last registered parameter comes first
        acc.close()


def test_grad_between_micro_steps_retain_graph_and_double_backward():
    """Documented: .grad is None between micro-steps and after the step, and holds the window's gradient during
    optimizer.step(). A backward the user runs outside the accumulator (retain_graph) is counted in the next
    micro-step; a gradient penalty (create_graph double backward) goes through the hooks like any loss."""
    model, ref = make_model(F64, 8), make_model(F64, 8)
    batches = make_batches(4, 3, F64, 8)

    def loss_fn(m, batch):
        loss = mse(m, batch)
        grads = torch.autograd.grad(loss, list(m.parameters()), create_graph=True)
        return loss + 0.1 * sum(g.square().sum() for g in grads)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    during = []
    opt.register_step_pre_hook(lambda *_: during.append([p.grad is not None for p in model.parameters()]))
    with GradientAccumulator(model, opt, GradientAccumulationConfig(accumulation_steps=2)) as acc:
        for batch in batches:
            with acc.micro_step():
                loss = loss_fn(model, batch)
                (0.5 * loss).backward(retain_graph=True)  # outside the accumulator: lands in .grad
                assert all(p.grad is not None for p in model.parameters())
                acc.backward(loss)
            assert all(p.grad is None for p in model.parameters())
    assert during == [[True] * 4] * 2
    plain_loop(ref, batches, 2, lambda m, b: 1.5 * loss_fn(m, b))
    assert_params_close(model, ref, F64)


def test_compiled_model_equals_eager():
    eager, compiled_model = make_model(torch.float32, 9), make_model(torch.float32, 9)
    batches = make_batches(4, 5, torch.float32, 9)
    config = GradientAccumulationConfig(accumulation_steps=2, bucket_size_bytes=64)
    with GradientAccumulator(eager, torch.optim.SGD(eager.parameters(), lr=0.1), config) as acc:
        run(acc, batches)
    compiled = torch.compile(compiled_model, backend="aot_eager")
    with GradientAccumulator(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1), config) as acc:
        run(acc, batches)
    assert_params_close(compiled_model, eager, torch.float32)


def test_release_buffers_and_no_persistent_cast_copies():
    model = make_model(torch.float32, 10).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    batches = [(x.bfloat16(), y.bfloat16()) for x, y in make_batches(6, 3, torch.float32, 10)]
    results = []
    for release, m in ((True, model), (False, ref)):
        config = GradientAccumulationConfig(accumulation_steps=3, release_buffers=release)
        with GradientAccumulator(m, torch.optim.SGD(m.parameters(), lr=0.1), config) as acc:
            for batch in batches:
                with acc.micro_step():
                    closed = acc.backward(mse(m, batch))
                assert all(p.grad is None for p in m.parameters())  # no cast copy outlives the step
                held = {d: f.numel() for d, f in acc._buffers.flats.items()}
                if closed and release:
                    assert held == {}
                else:  # only the fp32 buffers, padded to 16 B per view
                    assert list(held) == [torch.float32]
                    assert held[torch.float32] == sum(-(-p.numel() // 4) * 4 for p in m.parameters())
            results.append(acc.grad_norm_history())
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)  # re-created buffers, same arithmetic
    assert_params_close(model, ref, torch.float32)


def test_hooks_have_an_owner():
    model = make_model(F64, 11)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = GradientAccumulationConfig(accumulation_steps=2)
    acc = GradientAccumulator(model, opt, config)
    assert all(hook_count(p) == 1 for p in model.parameters())
    with pytest.raises(RuntimeError, match="already belongs to another GradientAccumulator"):
        GradientAccumulator(model, opt, config)
    assert all(hook_count(p) == 1 for p in model.parameters())  # the failed one registered nothing
    acc.close()
    acc.close()  # idempotent
    assert all(hook_count(p) == 0 for p in model.parameters())
    mse(model, make_batches(1, 3, F64, 11)[0]).backward()
    assert all(p.grad is not None for p in model.parameters())  # plain .grad behaviour again
    with pytest.raises(RuntimeError, match="closed"):
        acc.backward(mse(model, make_batches(1, 3, F64, 11)[0]))
    model.zero_grad(set_to_none=True)
    with GradientAccumulator(model, opt, config):
        assert all(hook_count(p) == 1 for p in model.parameters())
    assert all(hook_count(p) == 0 for p in model.parameters())
    acc = GradientAccumulator(model, opt, config)
    del acc
    gc.collect()
    assert all(hook_count(p) == 0 for p in model.parameters())  # garbage collection removed the hooks
    GradientAccumulator(model, opt, config).close()


def test_bad_input_names_the_field_and_writes_nothing():
    for bad in (0, -1, 1.5, True, "25MB", None):
        with pytest.raises(ValueError, match="bucket_size_bytes"):
            GradientAccumulationConfig(accumulation_steps=2, bucket_size_bytes=bad)
    with pytest.raises(ValueError, match="release_buffers"):
        GradientAccumulationConfig(accumulation_steps=2, release_buffers=1)
    cpu = torch.nn.Parameter(torch.randn(3))
    meta = torch.nn.Parameter(torch.empty(3, device="meta"))
    cpu.grad = torch.randn(3)
    before = cpu.grad.clone()
    with pytest.raises(ValueError, match="one device"):
        GradientAccumulator([cpu, meta], torch.optim.SGD([cpu, meta], lr=0.1), GradientAccumulationConfig(2))
    assert hook_count(cpu) == 0 and torch.equal(cpu.grad, before)


def test_failed_backward_after_folding():
    """Folded first writes are undone exactly; a failure after adding to earlier micro-steps' sums discards the
    window, and the accumulator refuses to go on until discard_window() (a retry would be silently wrong)."""
    model = make_model(F64, 12)
    batches = make_batches(3, 3, F64, 12)

    def failing(m, batch):
        x, y = batch  # the last layer's gradients are folded (bucket of 1 byte) before the first layer fails
        return F.mse_loss(m[2](m[1](FailInBackward.apply(m[0](x)))), y)

    config = GradientAccumulationConfig(accumulation_steps=3, bucket_size_bytes=1)
    with GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), config) as acc:
        for lost in (False, True):
            if lost:
                with acc.micro_step():
                    acc.backward(mse(model, batches[0]))
            with pytest.raises(RuntimeError, match="injected"):
                with acc.micro_step():
                    acc.backward(failing(model, batches[1]))
            assert acc._sums.indices() == [] and acc.micro_steps_in_window == 0
            if lost:  # refused, with nothing written, until the caller drops the window
                for call in (acc.micro_step().__enter__, acc.flush, lambda: acc.backward(mse(model, batches[0]))):
                    with pytest.raises(RuntimeError, match="the open window was lost"):
                        call()
                acc.discard_window()
        ref = copy.deepcopy(model)
        run(acc, batches)
    plain_loop(ref, batches, 3)
    assert_params_close(model, ref, F64)


def test_checkpoint_of_version_1_still_loads():
    model, ref = make_model(F64, 13), make_model(F64, 13)
    batches = make_batches(5, 3, F64, 13)
    config = GradientAccumulationConfig(accumulation_steps=3)
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    for batch in batches[:2]:
        with acc.micro_step():
            acc.backward(mse(model, batch))
    state = acc.state_dict()
    assert state["version"] == STATE_VERSION
    # Version 1 held one unpadded flat buffer per dtype in registration order, and a seen list.
    grads = state["buffers"]["grads"]
    v1 = {
        **state,
        "version": 1,
        "buffers": {"flats": {"torch.float64": torch.cat([g.flatten() for g in grads])}, "seen": [True] * 4},
    }
    acc.close()
    resumed = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    resumed.load_state_dict(v1)
    run(resumed, batches[2:])
    plain_loop(ref, batches, 3)
    assert_params_close(model, ref, F64)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0, 0.0])
def test_reference_norm_makes_no_gradient_sized_temporary(norm_type):
    """The pure-PyTorch global norm (no extension built, float64 buffers) reduces tensor by tensor: its temporaries
    stay within two of the largest tensor, not a concatenation of all of them (issue 11)."""
    g = torch.Generator().manual_seed(8)
    tensors = [torch.randn(128, 128, generator=g) for _ in range(8)]  # 64 KiB each, 512 KiB in all
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        got = reference.global_norm(tensors, norm_type, False)[0]
    peak = allocated_bytes(prof)[0]
    assert 0 < peak <= 2 * tensors[0].nbytes + 1024
    flat = torch.cat([t.reshape(-1) for t in tensors]).double()
    torch.testing.assert_close(got.double(), torch.linalg.vector_norm(flat, norm_type), rtol=1e-5, atol=0)
