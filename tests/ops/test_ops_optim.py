"""The fused optimizer ops of the test table (_optim_inputs.OPTIMIZERS): float64 against the reference,
against torch.optim (AdamW, SGD) and a float64 formula (Lion), float32 against torch's AdamW(fused=True)
/ SGD and lion-pytorch's Lion, the found_inf skip, and opcheck."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from _devices import require_ext
from _optim_inputs import (
    ADAM_CONFIGS,
    BY_NAME,
    LION_CONFIGS,
    OPTIMIZERS,
    SGD_CONFIGS,
    StepInputs,
    make_inputs,
    row_configs,
    torch_optimizer,
)
from _oracle import ODD_SIZES, assert_bits_unchanged, assert_close, small_sizes, snapshot

import gradacc_ext
from gradacc_ext.ops import sgd_step_
from gradacc_ext.ops.optim_args import RECORDS

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
F64, F32 = torch.float64, torch.float32


def run_adamw(x: StepInputs, backend: str, lr, **kw) -> None:
    BY_NAME["adamw"].call(x, backend, lr, **kw)


def run_sgd(x: StepInputs, backend: str, lr, **kw) -> None:
    BY_NAME["sgd"].call(x, backend, lr, **kw)


def layout_sizes(layout: str, gen: torch.Generator) -> list[int]:
    return list(ODD_SIZES) if layout in ("odd", "unaligned") else small_sizes(gen, count=300)


def assert_all_close64(got: StepInputs, want: StepInputs, rtol: float = 1e-12) -> None:
    for g_list, w_list in zip(got.lists(), want.lists(), strict=True):
        for g, w in zip(g_list, w_list, strict=True):
            torch.testing.assert_close(g, w, rtol=rtol, atol=rtol * float(w.abs().max()), equal_nan=True)
    for g, w in zip(got.steps, want.steps, strict=True):
        assert torch.equal(g, w)


# ---- float64: the kernel against the reference, both against torch.optim -----------------------


@pytest.mark.parametrize("layout", ["odd", "unaligned", "many"])
@pytest.mark.parametrize(("info", "config"), row_configs())
def test_float64_kernel_matches_reference(ext_device, gen, layout, info, config):
    opts = {"weight_decay": 0.02, **info.configs[config]}
    x = make_inputs(layout_sizes(layout, gen), F64, ext_device, gen, optimizer=info.name,
                    amsgrad=bool(opts.get("amsgrad")), unaligned=layout == "unaligned",
                    shared_step=layout == "many")  # fmt: skip
    mult = torch.full((), float(torch.rand((), generator=gen)) + 0.5, device=ext_device)
    lr = torch.full((), info.lr, device=ext_device)
    want = x.clone()
    info.call(want, "torch", lr, grad_mult=mult, **opts)
    info.call(x, "ext", lr, grad_mult=mult, **opts)
    assert_all_close64(x, want)


@pytest.mark.parametrize("config", list(ADAM_CONFIGS))
def test_adamw_float64_matches_torch_optim(device, backend, gen, config):
    """Three steps from random state: the semantics (bias correction, decay, amsgrad, maximize) are torch's."""
    opts = {"weight_decay": 0.05, **ADAM_CONFIGS[config]}
    x = make_inputs([7, 300, 65537], F64, device, gen, amsgrad=bool(opts.get("amsgrad")))
    opt, leaves = torch_optimizer(x, "adamw", lr=1e-2, foreach=False, **opts)
    for _ in range(3):
        opt.step()
        run_adamw(x, backend, 1e-2, **opts)
    for p, leaf in zip(x.params, leaves, strict=True):
        torch.testing.assert_close(p, leaf.detach(), rtol=1e-12, atol=1e-14)
    assert [float(s) for s in x.steps] == [float(opt.state[leaf]["step"]) for leaf in leaves]


@pytest.mark.parametrize("config", list(SGD_CONFIGS))
@pytest.mark.parametrize("first", [True, False], ids=["first_step", "later"])
def test_sgd_float64_matches_torch_optim(device, backend, gen, config, first):
    x = make_inputs([7, 300, 65537], F64, device, gen, optimizer="sgd", first_step=first)
    opt, leaves = torch_optimizer(x, "sgd", lr=0.05, foreach=False, **SGD_CONFIGS[config])
    for _ in range(3):
        opt.step()
        run_sgd(x, backend, 0.05, **SGD_CONFIGS[config])
    for p, leaf in zip(x.params, leaves, strict=True):
        torch.testing.assert_close(p, leaf.detach(), rtol=1e-12, atol=1e-14)


# ---- float32 against torch's own fused / single-tensor implementations --------------------------


@pytest.mark.parametrize("config", list(ADAM_CONFIGS))
def test_adamw_float32_matches_torch_fused(device, backend, gen, config):
    """Five steps; each costs at most ~8 fp32 roundings of the param or the lr-sized update."""
    opts, steps, lr = {"weight_decay": 0.1, **ADAM_CONFIGS[config]}, 5, 1e-2
    x = make_inputs([1, 65535, 65537, 1000], F32, device, gen, amsgrad=bool(opts.get("amsgrad")))
    opt, leaves = torch_optimizer(x, "adamw", lr=lr, fused=True, **opts)
    for _ in range(steps):
        opt.step()
        run_adamw(x, backend, lr, **opts)
    for i, leaf in enumerate(leaves):
        want = leaf.detach().double()
        assert_close(x.params[i], want, want.abs() + 10 * lr, 8 * steps, f"params[{i}]")
        state = opt.state[leaf]
        magnitude = state["exp_avg"].abs().double() + x.grads[i].abs().double()  # lerp toward the grad
        assert_close(x.exp_avgs[i], state["exp_avg"].double(), magnitude, 8 * steps, f"exp_avgs[{i}]")
        assert float(x.steps[i]) == float(state["step"])


@pytest.mark.parametrize("config", list(SGD_CONFIGS))
def test_sgd_float32_matches_torch(device, backend, gen, config):
    opts, steps, lr = SGD_CONFIGS[config], 5, 0.05
    x = make_inputs([1, 65535, 65537, 1000], F32, device, gen, optimizer="sgd")
    opt, leaves = torch_optimizer(x, "sgd", lr=lr, foreach=False, **opts)
    for _ in range(steps):
        opt.step()
        run_sgd(x, backend, lr, **opts)
    for i, leaf in enumerate(leaves):
        want = leaf.detach().double()
        scale = lr * (x.grads[i].abs().double() + opt.state[leaf].get("momentum_buffer", x.grads[i]).abs().double())
        assert_close(x.params[i], want, want.abs() + 10 * scale, 6 * steps, f"params[{i}]")


# ---- Lion: a float64 formula and lion-pytorch, independent of our reference ---------------------


def lion_formula(p, g, m, lr: float, betas, weight_decay: float, maximize: bool = False):
    """Lion in float64, written out: (new param, new exp_avg)."""
    b1, b2 = betas
    g = -g if maximize else g
    p = p * (1 - lr * weight_decay) - lr * torch.sign(b1 * m + (1 - b1) * g)
    return p, b2 * m + (1 - b2) * g


@pytest.mark.parametrize("config", list(LION_CONFIGS))
def test_lion_float64_matches_the_formula(device, backend, gen, config):
    """Three steps, the step counts untouched by the math: the formula in float64 exactly."""
    opts, lr = LION_CONFIGS[config], 1e-2
    x = make_inputs([7, 300, 65537], F64, device, gen, optimizer="lion")
    want = [(p.clone(), m.clone()) for p, m in zip(x.params, x.exp_avgs, strict=True)]
    betas = opts.get("betas", (0.9, 0.99))
    for _ in range(3):
        BY_NAME["lion"].call(x, backend, lr, **opts)
        want = [lion_formula(p, g, m, lr, betas, opts.get("weight_decay", 0.0), opts.get("maximize", False))
                for (p, m), g in zip(want, x.grads, strict=True)]  # fmt: skip
    for i, (p, m) in enumerate(want):
        torch.testing.assert_close(x.params[i], p, rtol=1e-14, atol=1e-15)
        torch.testing.assert_close(x.exp_avgs[i], m, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("config", ["plain", "decay"])
def test_lion_float32_matches_lion_pytorch(device, backend, gen, config):
    """Ten fp32 steps against lion-pytorch's Lion (PyPI) from the same params and exp_avg: each step
    costs the param at most a few fp32 roundings; a sign decided by rounding would cost 2 lr."""
    from lion_pytorch import Lion

    opts, steps, lr = {"weight_decay": 0.1, **LION_CONFIGS[config]}, 10, 1e-3
    x = make_inputs([1, 300, 1000], F32, device, gen, optimizer="lion")
    leaves = [p.detach().clone().requires_grad_(True) for p in x.params]
    ref = Lion(leaves, lr=lr, **opts)
    for leaf, g, m in zip(leaves, x.grads, x.exp_avgs, strict=True):
        leaf.grad = g.clone()
        ref.state[leaf]["exp_avg"] = m.clone()
    for _ in range(steps):
        ref.step()
        BY_NAME["lion"].call(x, backend, lr, **opts)
    for i, leaf in enumerate(leaves):
        want = leaf.detach().double()
        assert_close(x.params[i], want, want.abs() + lr, 4 * steps, f"params[{i}]")
        m = ref.state[leaf]["exp_avg"].double()
        assert_close(x.exp_avgs[i], m, m.abs() + x.grads[i].abs().double(), 4 * steps, f"exp_avgs[{i}]")


def test_grad_mult_and_lr_tensor_scale_like_their_values(device, backend, gen):
    """grad_mult multiplies the grads and lr_tensor the rate: SGD by lr * m * g, exactly for powers of 2."""
    x = make_inputs([513, 65537], F32, device, gen, optimizer="sgd")
    want = [p - 0.25 * 0.5 * g for p, g in zip(x.params, x.grads, strict=True)]
    sgd_step_(x.params, x.grads, lr=torch.full((), 0.5, device=device), grad_mult=torch.full((), 0.25, device=device),
              backend=backend)  # fmt: skip
    for got, w in zip(x.params, want, strict=True):
        assert torch.equal(got, w)


# ---- found_inf: nothing written ------------------------------------------------------------------


@pytest.mark.parametrize("info", OPTIMIZERS, ids=lambda i: i.name)
@pytest.mark.parametrize("mode", ["nearest", "master", "stochastic"])
def test_found_inf_skips_everything(device, backend, gen, info, mode):
    dtype = F32 if mode == "nearest" else torch.bfloat16
    x = make_inputs([5, 65537, 300], dtype, device, gen, grad_dtype=F32, optimizer=info.name, amsgrad=True,
                    masters=mode == "master")  # fmt: skip
    before = snapshot(x.all_tensors())
    found = torch.ones((), device=device)
    kw = {"found_inf": found, "mode": mode, "seed": 3, **({"momentum": 0.9} if info.name == "sgd" else {})}
    info.call(x, backend, info.lr, **kw)
    assert_bits_unchanged(before, x.all_tensors(), "step inputs")
    found.zero_()  # the same call with the flag clear does step
    info.call(x, backend, info.lr, **kw)
    # some param moves (one small bf16 param may round back to itself: a step below its ulp)
    assert any(not torch.equal(b, a) for b, a in zip(before, snapshot(x.params), strict=False))


# ---- registration ---------------------------------------------------------------------------------


def opcheck_samples(info, device: str, gen: torch.Generator) -> list[tuple]:
    """fp32 params with every optional scalar tensor; bf16 params with fp32 grads and masters; fp16
    params in stochastic mode with one shared step count."""

    def scalar(v: float) -> torch.Tensor:
        return torch.full((), v, device=device)

    name, config = info.name, list(info.configs.values())[-1]  # the last config of each row takes every state list
    f = make_inputs([7, 65537], F32, device, gen, optimizer=name, amsgrad=True)
    b = make_inputs([9, 300], torch.bfloat16, device, gen, grad_dtype=F32, optimizer=name, masters=True)
    s = make_inputs([9, 300], torch.float16, device, gen, grad_dtype=F32, optimizer=name, shared_step=True)
    return [
        info.record_of(f, config, 1e-3, (scalar(2.0), scalar(0.5), scalar(0.0)), "nearest", 0).args(),
        info.record_of(b, config, 1e-3, (None, None, None), "master", 0).args(),
        info.record_of(s, config, 0.1, (None, scalar(0.5), None), "stochastic", 7).args(),
    ]


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("info", OPTIMIZERS, ids=lambda i: i.name)
def test_opcheck(ext_device, gen, info):
    op = getattr(torch.ops.gradacc, info.op)
    written = {a.name for a in op.default._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert "params" in written and "grads" not in written
    for args in opcheck_samples(info, ext_device, gen):
        torch.library.opcheck(op.default, args)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=lambda i: i.name)
def test_op_is_registered_for_every_backend(ext_device, info):
    op = f"gradacc::{info.op}"
    for key in ("CPU", "Meta", "SparseCPU"):  # Meta: the fake; Sparse: the checks reject sparse grads by name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, key), key
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA") == gradacc_ext.extension_has_cuda()


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.NAME)
def test_argument_record_is_the_schema(record):
    """The Python record of an op (gradacc_ext.ops.optim_args) lists the compiled schema's arguments
    in its order: record.args() is the op's positional call."""
    require_ext("cpu")
    schema = getattr(torch.ops.gradacc, record.NAME).default._schema
    assert list(record.schema_order()) == [a.name for a in schema.arguments]
    assert set(record.schema_order()) == {f.name for f in fields(record)}


# The public schemas as released: the traits and csrc/optim_args.h generate them, and must
# keep generating them character for character.
# Issue 30 added the int8 scales lists (<state>_scales, alias sets g, h, i) after the state lists.
RELEASED_SCHEMAS = {
    "adamw_step_": "gradacc::adamw_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
    "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor(g!)[] exp_avgs_scales, "
    "Tensor(h!)[] exp_avg_sqs_scales, Tensor(i!)[] max_exp_avg_sqs_scales, Tensor(e!)[] master_params, "
    "Tensor(f!)[] steps, float lr, Tensor? lr_tensor, Tensor? grad_mult, Tensor? found_inf, float beta1, "
    "float beta2, float eps, float weight_decay, bool maximize, int param_mode, int seed) -> ()",
    "sgd_step_": "gradacc::sgd_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
    "Tensor(g!)[] momentum_buffers_scales, Tensor(e!)[] master_params, Tensor(f!)[] steps, float lr, "
    "Tensor? lr_tensor, Tensor? grad_mult, Tensor? found_inf, float momentum, float dampening, "
    "float weight_decay, bool nesterov, bool maximize, int param_mode, int seed) -> ()",
    "lion_step_": "gradacc::lion_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
    "Tensor(g!)[] exp_avgs_scales, Tensor(e!)[] master_params, Tensor(f!)[] steps, float lr, "
    "Tensor? lr_tensor, Tensor? grad_mult, Tensor? found_inf, float beta1, float beta2, float weight_decay, "
    "bool maximize, int param_mode, int seed) -> ()",
}


@pytest.mark.parametrize("name", list(RELEASED_SCHEMAS))
def test_released_schemas_are_unchanged(name):
    require_ext("cpu")
    assert str(getattr(torch.ops.gradacc, name).default._schema) == RELEASED_SCHEMAS[name]


def test_ops_are_exported():
    assert {info.op for info in OPTIMIZERS} == {r.NAME for r in RECORDS}
    for info in OPTIMIZERS:
        assert getattr(gradacc_ext.ops, info.op) is getattr(gradacc_ext.ops.optim_api, info.op)
