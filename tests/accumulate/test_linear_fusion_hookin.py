"""gradient_accumulation_fusion's hook-in (accumulate/linear_fusion.py): what it leaves intact and what it refuses.

close() and garbage collection restore the model exactly; a deepcopy while owned is a plain model; frozen
layers, backwards outside the accumulator and gradient penalties; torch.compile falls back (a compiled model,
with a reason) or traces plain F.linear; per-parameter fallbacks (bf16 on CPU); autocast; bad input; the
gradacc::wgrad_addmm_ op's fake kernel and CPU probe (its CUDA test: test_linear_fusion.py).
"""

from __future__ import annotations

import copy
import gc
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from _dist import (
    STEPS,
    assert_params_equal,
    fsdp_model,
    global_batches,
    launch,
    loss_and_items,
    make_optimizer,
    needs_gloo,
    reference,
    shard,
)
from test_linear_fusion import (
    FUSION,
    TOL,
    assert_params_close,
    make_batches,
    make_model,
    micro_loss,
    plain_loop,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from gradacc_ext import GradientAccumulator
from gradacc_ext.accumulate.config import GradientAccumulationConfig
from gradacc_ext.ops import wgrad

SEED_FSDP = 5  # the data seed of the FSDP2 case


def test_close_restores_the_model_exactly():
    model = make_model(torch.float32, 5)
    before = [dict(vars(m)) for m in model.modules()]
    acc = GradientAccumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), GradientAccumulationConfig(accumulation_steps=2, **FUSION)
    )
    assert "forward" in vars(model[0]) and "forward" in vars(model[2])
    acc.close()
    acc.close()  # idempotent
    assert [dict(vars(m)) for m in model.modules()] == before
    assert model[0].forward.__func__ is nn.Linear.forward
    # A second accumulator can own the model again, and garbage collection restores it too.
    acc = GradientAccumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), GradientAccumulationConfig(accumulation_steps=2, **FUSION)
    )
    del acc
    gc.collect()
    assert [dict(vars(m)) for m in model.modules()] == before


def test_deepcopy_while_owned_is_a_plain_model_and_pickling_is_refused():
    """An EMA-style copy.deepcopy(model) computes like nn.Linear and never writes the accumulator's buffers."""
    model = make_model(torch.float64, 9)
    acc = GradientAccumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), GradientAccumulationConfig(accumulation_steps=2, **FUSION)
    )
    twin = copy.deepcopy(model)
    x, y = make_batches(1, torch.float64, 9)[0]
    with torch.no_grad():
        twin[0].weight.add_(1.0)  # the copy computes with its own parameters ...
        torch.testing.assert_close(twin[0](x), F.linear(x, twin[0].weight, twin[0].bias), rtol=0, atol=0)
        twin[0].weight.sub_(1.0)
    with acc.micro_step():
        F.mse_loss(twin(x), y).backward()  # armed by nothing: the copy's gradients go to its own .grad
        acc.backward(F.mse_loss(model(x), y))
    for view, p in zip(acc._buffers.views, twin.parameters(), strict=True):
        torch.testing.assert_close(view, p.grad, **TOL[torch.float64])
    with pytest.raises(TypeError, match="cannot be pickled while the accumulator owns the model"):
        torch.save(model, io.BytesIO())
    acc.close()
    torch.save(model, io.BytesIO())


def test_frozen_layer_and_backward_outside_the_accumulator():
    """A frozen Linear is not fused; a retain_graph backward outside the accumulator lands in .grad and the next
    micro-step counts it (as on the hooks path); a gradient penalty (create_graph) goes through too."""
    dtype, n, seed = torch.float64, 2, 41
    batches = make_batches(4, dtype, seed)

    def loss_fn(m, batch):
        loss = F.mse_loss(m(batch[0]), batch[1])
        grads = torch.autograd.grad(loss, [p for p in m.parameters() if p.requires_grad], create_graph=True)
        return loss + 0.1 * sum(g.square().sum() for g in grads)

    models = []
    for fused in (True, False):
        model = make_model(dtype, seed)
        model[0].requires_grad_(False)
        cfg = GradientAccumulationConfig(accumulation_steps=n, gradient_accumulation_fusion=fused)
        acc = GradientAccumulator(model, torch.optim.SGD(model[2].parameters(), lr=0.1), cfg)
        for batch in batches:
            with acc.micro_step():
                loss = loss_fn(model, batch)
                (0.5 * loss).backward(retain_graph=True)  # outside the accumulator: lands in .grad
                assert model[2].weight.grad is not None and model[0].weight.grad is None
                acc.backward(loss)
        assert "forward" not in vars(model[0]) and (acc.stats.fused_linear_params == 2) == fused
        models.append(model)
    ref = make_model(dtype, seed)
    ref[0].requires_grad_(False)
    opt = torch.optim.SGD(ref[2].parameters(), lr=0.1)
    for start in range(0, len(batches), n):
        opt.zero_grad()
        (1.5 * sum(loss_fn(ref, b) for b in batches[start : start + n]) / n).backward()
        opt.step()
    assert_params_close(models[0], ref, dtype)
    assert_params_close(models[0], models[1], dtype)


def test_torch_compile_model_falls_back_with_reason_and_matches():
    dtype, n, seed = torch.float32, 2, 31
    batches = make_batches(4, dtype, seed)
    model, ref = make_model(dtype, seed), make_model(dtype, seed)
    compiled = torch.compile(model, backend="aot_eager")
    cfg = GradientAccumulationConfig(accumulation_steps=n, **FUSION)
    acc = GradientAccumulator(compiled, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), cfg)
    assert acc.stats.fused_linear_params == 0
    assert set(acc.stats.linear_fusion_fallbacks) == {
        "_orig_mod.0.weight",
        "_orig_mod.0.bias",
        "_orig_mod.2.weight",
        "_orig_mod.2.bias",
    }
    assert "torch.compile" in acc.stats.linear_fusion_fallbacks["_orig_mod.0.weight"]
    assert acc.get_accumulation_stats()["linear_fusion_fallbacks"] == acc.stats.linear_fusion_fallbacks
    for batch in batches:
        with acc.micro_step():
            acc.backward(*micro_loss(compiled, batch, "mean", n))
    plain_loop(ref, batches, n, "mean")
    assert_params_close(model, ref, dtype)


def test_compiled_loss_inside_fused_model_goes_through_hooks():
    """torch.compile of a function that calls the fused model: traced Linears use F.linear (hooks path)."""
    dtype, n, seed = torch.float32, 2, 37
    batches = make_batches(4, dtype, seed)
    model, ref = make_model(dtype, seed), make_model(dtype, seed)
    cfg = GradientAccumulationConfig(accumulation_steps=n, **FUSION)
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), cfg)
    loss_fn = torch.compile(lambda x, y: F.mse_loss(model(x), y), backend="aot_eager")
    for x, y in batches:
        with acc.micro_step():
            acc.backward(loss_fn(x, y))
    plain_loop(ref, batches, n, "mean")
    assert_params_close(model, ref, dtype)


def test_bf16_params_on_cpu_fall_back_per_parameter_with_reason():
    seed, n = 13, 2
    batches = [(x.bfloat16(), y.bfloat16()) for x, y in make_batches(4, torch.float32, seed)]
    model = make_model(torch.float32, seed)
    model[2].bfloat16()  # one bf16 layer: its parameters fall back, the fp32 layer is fused
    hooks_model = make_model(torch.float32, seed)
    hooks_model[2].bfloat16()
    cfg = GradientAccumulationConfig(accumulation_steps=n, **FUSION)
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    assert acc.stats.fused_linear_params == 2
    assert set(acc.stats.linear_fusion_fallbacks) == {"2.weight", "2.bias"}
    assert "mixed-dtype" in acc.stats.linear_fusion_fallbacks["2.weight"]
    hooks_acc = GradientAccumulator(
        hooks_model, torch.optim.SGD(hooks_model.parameters(), lr=0.1), GradientAccumulationConfig(accumulation_steps=n)
    )

    def loss(m, b):
        return F.mse_loss(m[2](torch.tanh(m[0](b[0].float())).bfloat16()).float(), b[1].float())

    for a, m in ((acc, model), (hooks_acc, hooks_model)):
        for b in batches:
            with a.micro_step():
                a.backward(loss(m, b))
    for p, q in zip(model.parameters(), hooks_model.parameters(), strict=True):
        torch.testing.assert_close(p.float(), q.float(), rtol=2e-5, atol=2e-6)


def test_autocast_bf16_over_fp32_params_on_cpu_matches_hooks_path():
    """Autocast activations with fp32 params: the fused GEMM multiplies the same bf16 inputs, in fp32 (the hooks
    path rounds dW to bf16 first), so both agree to bf16 resolution and the fused one is closer to float64."""
    seed, n = 43, 2
    batches = make_batches(4, torch.float32, seed)
    models = {}
    for fused in (False, True):
        model = make_model(torch.float32, seed)
        cfg = GradientAccumulationConfig(
            accumulation_steps=n, mixed_precision="bf16", gradient_accumulation_fusion=fused
        )
        acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
        for b in batches:
            with acc.micro_step():
                acc.backward(micro_loss(model, b, "mean", n)[0].float())
        models[fused] = model
    for p, q in zip(models[True].parameters(), models[False].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-3)


def test_bad_input():
    model = make_model(torch.float32, 1)
    for conflict in (dict(grad_views=True), dict(ddp_reduce="overlap")):
        name = "grad_views=True" if "grad_views" in conflict else "ddp_reduce='overlap'"
        with pytest.raises(ValueError, match=f"gradient_accumulation_fusion=True cannot be combined with {name}"):
            GradientAccumulationConfig(accumulation_steps=2, **conflict, **FUSION)
    with pytest.raises(ValueError, match="gradient_accumulation_fusion must be a bool"):
        GradientAccumulationConfig(accumulation_steps=2, gradient_accumulation_fusion="yes")
    conv = nn.Sequential(nn.Conv1d(2, 3, 3))
    with pytest.warns(UserWarning, match="no nn.Linear .none found.: nothing is fused"):
        GradientAccumulator(
            conv, torch.optim.SGD(conv.parameters(), lr=0.1), GradientAccumulationConfig(accumulation_steps=2, **FUSION)
        ).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc = GradientAccumulator(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            GradientAccumulationConfig(accumulation_steps=2, **FUSION),
        )
    acc.close()  # a parameter replaced while owned runs unfused, as nn.Linear: test_linear_fusion_calls.py


def test_wgrad_op_fake_kernel_and_cpu_probe():
    assert "no mixed-dtype" in wgrad.probe(torch.device("cpu"))
    out = torch.empty(4, 6, device="meta")
    a, b = (
        torch.empty(4, 5, device="meta", dtype=torch.bfloat16),
        torch.empty(5, 6, device="meta", dtype=torch.bfloat16),
    )
    torch.ops.gradacc.wgrad_addmm_(out, a, b, 1.0, 1.0)
    with pytest.raises(TypeError, match="out must be float32"):
        torch.ops.gradacc.wgrad_addmm_(out.bfloat16(), a, b, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"out must be \[4, 6\]"):
        torch.ops.gradacc.wgrad_addmm_(out[:3], a, b, 1.0, 1.0)
    with pytest.raises(TypeError, match="both be float16 or bfloat16"):
        torch.ops.gradacc.wgrad_addmm_(out, a.float(), b, 1.0, 1.0)


def fsdp_worker(rank: int, world: int) -> None:
    model = fsdp_model(init_device_mesh("cpu", (world,)))
    opt = make_optimizer(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    config = GradientAccumulationConfig(accumulation_steps=STEPS, max_grad_norm=0.5, **FUSION)
    acc = GradientAccumulator(model, opt, config, sched)
    fallbacks = acc.stats.linear_fusion_fallbacks
    assert acc.stats.fused_linear_params == 0 and set(fallbacks) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert all("FSDP2" in why for why in fallbacks.values()) and "forward" not in vars(model[0])
    for batch in global_batches("mean", world, SEED_FSDP):
        with acc.micro_step():
            acc.backward(*loss_and_items(model, shard(batch, rank)))
    acc.flush()
    assert_params_equal(model, reference("mean", world, SEED_FSDP))


@pytest.mark.distributed
@needs_gloo
def test_fsdp2_parameters_fall_back_per_parameter_with_reason():
    """FSDP2 produces sharded gradients by reduce-scatter: its DTensor parameters stay on the hooks path."""
    launch(fsdp_worker, 2, timeout=90)
