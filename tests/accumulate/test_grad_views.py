"""config.grad_views: param.grad as a view of the flat buffer between micro-steps (autograd adds in place).

Float64 models (reference ops, tolerances ~1e-12) against the plain loop and against the hooks path
(grad_views=False) on copies of the same model; fresh random data in every test.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _cases import IN, FailInBackward, assert_params_close, make_batches, make_model, mse
from test_accumulator_memory import Tied, plain_loop, run

from gradacc_ext.accumulate.accumulator import GradientAccumulator
from gradacc_ext.accumulate.config import GradientAccumulationConfig

F64 = torch.float64


def in_buffers(acc: GradientAccumulator, grad: torch.Tensor) -> bool:
    return any(grad.untyped_storage().data_ptr() == f.untyped_storage().data_ptr() for f in acc._buffers.flats.values())


def outside_bytes(acc: GradientAccumulator) -> int:
    """Live gradient bytes the accumulator can see outside its buffers: queued, or in .grad."""
    held = list(acc._hooks._queue.values()) + [p.grad for p in acc.params if p.grad is not None]
    return sum(g.numel() * g.element_size() for g in held if not in_buffers(acc, g))


def tied_loss(m, batch):
    x, y, use = batch
    return F.mse_loss(m(x, use), y)


@pytest.mark.parametrize("bucket", [1, 25 * 1024 * 1024])
def test_views_equal_the_plain_loop_and_hold_nothing_outside_the_buffers(bucket):
    """Tied, unused and frozen params, a short last window; after a window's first micro-step every used
    parameter's .grad shares the buffer's storage, and no gradient is ever held outside the buffers."""
    torch.manual_seed(bucket % 89)
    model = Tied().to(F64)
    ref = copy.deepcopy(model)
    batches = [(*b, i % 3 != 1) for i, b in enumerate(make_batches(8, 4, F64, bucket % 83))]
    config = GradientAccumulationConfig(accumulation_steps=3, bucket_size_bytes=bucket, grad_views=True)
    with GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), config) as acc:
        seen = []
        probes = [p.register_post_accumulate_grad_hook(lambda p: seen.append(outside_bytes(acc))) for p in acc.params]
        folded = []
        real_add = acc._sums.add
        acc._sums.add = lambda index, grads, scale: (folded.append(list(index)), real_add(index, grads, scale))
        for k, batch in enumerate(batches):
            seen.clear()
            with acc.micro_step():
                closed = acc.backward(tied_loss(model, batch))
            used = [acc.params[i] for i in acc._sums.indices()]
            if closed:
                assert all(p.grad is None for p in acc.params)
            else:
                assert used and all(p.grad is not None and in_buffers(acc, p.grad) for p in used)
                assert outside_bytes(acc) == 0
            if k % 3:  # not a window's first micro-step: every used parameter's view is attached
                assert folded == [] and max(seen) == 0
            folded.clear()
        acc.flush()
        for h in probes:
            h.remove()
    norms = plain_loop(ref, batches, 3, tied_loss)
    assert_params_close(model, ref, F64)
    torch.testing.assert_close(acc.grad_norm_history().double(), torch.tensor(norms, dtype=F64), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "mode, num_items", [("mean", None), ("mean", [3, 1, 4, 2, 5]), ("sum", [3, 1, 4, 2, 5]), ("none", None)]
)
def test_views_equal_the_hooks_path(mode, num_items):
    """Every normalisation mode; weighted micro-steps (num_items in mean mode) detach the views."""
    torch.manual_seed(3)
    model = Tied().to(F64)
    models = [model, copy.deepcopy(model)]
    batches = [(*b, i != 2) for i, b in enumerate(make_batches(5, 4, F64, 31))]
    norms = []
    for views, m in zip((True, False), models, strict=True):
        config = GradientAccumulationConfig(accumulation_steps=2, loss_normalization=mode, grad_views=views)
        with GradientAccumulator(m, torch.optim.SGD(m.parameters(), lr=0.1), config) as acc:
            for k, batch in enumerate(batches):
                with acc.micro_step():
                    acc.backward(tied_loss(m, batch), None if num_items is None else num_items[k])
                weighted = mode == "mean" and num_items is not None
                if views and not weighted and acc.micro_steps_in_window:
                    assert any(p.grad is not None for p in m.parameters())
                else:
                    assert all(p.grad is None for p in m.parameters())
            acc.flush()
            norms.append(acc.grad_norm_history())
    assert_params_close(models[0], models[1], F64)
    torch.testing.assert_close(norms[0], norms[1], rtol=1e-6, atol=0)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_user_reads_and_drops_grad_between_micro_steps():
    """Documented: with views, .grad between micro-steps is the window's un-normalised running sum.
    A leftover zero_grad() between micro-steps loses nothing; a backward outside the accumulator
    (retain_graph) is counted; a gradient penalty through torch.autograd.grad works; backward(create_graph=True)
    outside the accumulator is refused, leaving the sum as it was."""
    model, ref = make_model(F64, 8), make_model(F64, 8)
    batches = make_batches(6, 3, F64, 8)

    def loss_fn(m, batch):
        loss = mse(m, batch)
        grads = torch.autograd.grad(loss, list(m.parameters()), create_graph=True)
        return loss + 0.1 * sum(g.square().sum() for g in grads)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = GradientAccumulationConfig(accumulation_steps=3, grad_views=True)
    with GradientAccumulator(model, opt, config) as acc:
        for k, batch in enumerate(batches):
            with acc.micro_step():
                loss = loss_fn(model, batch)
                if k % 3 == 1:
                    opt.zero_grad()  # drops the views, not the sum
                    (0.5 * loss).backward(retain_graph=True)  # outside the accumulator: counted
                elif k % 3 == 2:
                    before = [v.clone() for v in acc._buffers.views]
                    with pytest.raises(RuntimeError, match="create_graph=True"):
                        loss.backward(retain_graph=True, create_graph=True)
                    assert all(in_buffers(acc, p.grad) for p in model.parameters())
                    torch.testing.assert_close(acc._buffers.views, before, rtol=0, atol=0)
                acc.backward(loss)
            if k % 3 != 2:
                grads = [p.grad for p in model.parameters()]
                assert all(in_buffers(acc, g) for g in grads)
                assert all(g is v for g, v in zip(grads, acc._buffers.views, strict=True))
    weight = {id(b[0]): 1.5 if k % 3 == 1 else 1.0 for k, b in enumerate(batches)}
    plain_loop(ref, batches, 3, lambda m, b: weight[id(b[0])] * loss_fn(m, b))
    assert_params_close(model, ref, F64)


def test_failed_backward_into_views_discards_the_window():
    model = make_model(F64, 12)
    batches = make_batches(3, 3, F64, 12)

    def failing(m, batch):
        x, y = batch
        return F.mse_loss(m[2](m[1](FailInBackward.apply(m[0](x)))), y)

    config = GradientAccumulationConfig(accumulation_steps=3, grad_views=True)
    with GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), config) as acc:
        with acc.micro_step():
            acc.backward(mse(model, batches[0]))
        with pytest.raises(RuntimeError, match="injected"):
            with acc.micro_step():
                acc.backward(failing(model, batches[1]))
        assert acc._sums.indices() == [] and all(p.grad is None for p in model.parameters())
        with pytest.raises(RuntimeError, match="the open window was lost"), acc.micro_step():
            pass
        acc.discard_window()
        ref = copy.deepcopy(model)
        run(acc, batches)
    plain_loop(ref, batches, 3)
    assert_params_close(model, ref, F64)


def test_resume_and_mixed_dtypes():
    """A checkpoint taken with views attached resumes exactly, also into the same accumulator; bf16 params
    with fp32 accumulation never get views (dtypes differ), fp32 params beside them do."""
    model = torch.nn.Sequential(torch.nn.Linear(IN, 6), torch.nn.Linear(6, 3).to(torch.bfloat16))
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(14)
    batches = [(torch.randn(4, IN, generator=g), torch.randn(4, 3, generator=g)) for _ in range(6)]

    def loss_fn(m, batch):
        return F.mse_loss(m[1](m[0](batch[0]).bfloat16()).float(), batch[1])

    results = []
    for views, m in ((True, model), (False, ref)):
        config = GradientAccumulationConfig(accumulation_steps=3, grad_views=views)
        acc = GradientAccumulator(m, torch.optim.SGD(m.parameters(), lr=0.1), config)
        for k, batch in enumerate(batches):
            with acc.micro_step():
                acc.backward(loss_fn(m, batch))
            if k == 3:
                assert [p.grad is not None for p in m.parameters()] == [views, views, False, False]
            if k in (2, 3):  # at a window's end (nothing seen) and mid-window, with views attached
                state = acc.state_dict()
                for extra in batches[:2]:  # micro-batches the checkpoint does not hold
                    with acc.micro_step():
                        acc.backward(loss_fn(m, extra))
                acc.load_state_dict(state)
        results.append(acc.grad_norm_history())
        acc.close()
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_compiled_model_with_views_equals_eager():
    eager, compiled_model = make_model(torch.float32, 9), make_model(torch.float32, 9)
    batches = make_batches(4, 5, torch.float32, 9)
    config = GradientAccumulationConfig(accumulation_steps=2, grad_views=True)
    with GradientAccumulator(eager, torch.optim.SGD(eager.parameters(), lr=0.1), config) as acc:
        run(acc, batches)
    compiled = torch.compile(compiled_model, backend="aot_eager")
    with GradientAccumulator(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1), config) as acc:
        run(acc, batches)
    assert_params_close(compiled_model, eager, torch.float32)


def test_grad_views_must_be_a_bool():
    with pytest.raises(ValueError, match="grad_views must be a bool"):
        GradientAccumulationConfig(accumulation_steps=2, grad_views=1)
