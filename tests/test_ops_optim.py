"""adamw_step_ and sgd_step_: float64 against the reference and torch.optim, float32 against torch's
AdamW(fused=True) / SGD, the found_inf skip, and opcheck."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from _optim_inputs import ADAM_CONFIGS, SGD_CONFIGS, StepInputs, make_inputs, torch_optimizer
from _oracle import ODD_SIZES, assert_bits_unchanged, assert_close, small_sizes, snapshot
from conftest import require_ext

import gradacc_ext
from gradacc_ext.ops import adamw_step_, sgd_step_
from gradacc_ext.ops.optim_args import RECORDS

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
F64, F32 = torch.float64, torch.float32


def run_adamw(x: StepInputs, backend: str, lr, **kw) -> None:
    opts = {k: v for k, v in kw.items() if k != "amsgrad"}
    adamw_step_(
        x.params, x.grads, x.exp_avgs, x.exp_avg_sqs, x.steps, lr=lr, max_exp_avg_sqs=x.max_exp_avg_sqs,
        master_params=x.master_params, backend=backend, **opts,
    )  # fmt: skip


def run_sgd(x: StepInputs, backend: str, lr, **kw) -> None:
    buffers = x.exp_avgs if kw.get("momentum", 0.0) else []
    sgd_step_(x.params, x.grads, lr=lr, momentum_buffers=buffers, steps=x.steps, master_params=x.master_params,
              backend=backend, **kw)  # fmt: skip


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
@pytest.mark.parametrize("config", list(ADAM_CONFIGS))
def test_adamw_float64_kernel_matches_reference(ext_device, gen, layout, config):
    opts = {"weight_decay": 0.02, **ADAM_CONFIGS[config]}
    x = make_inputs(layout_sizes(layout, gen), F64, ext_device, gen, amsgrad=bool(opts.get("amsgrad")),
                    unaligned=layout == "unaligned", shared_step=layout == "many")  # fmt: skip
    mult = torch.full((), float(torch.rand((), generator=gen)) + 0.5, device=ext_device)
    lr = torch.full((), 2e-3, device=ext_device)
    want = x.clone()
    run_adamw(want, "torch", lr, grad_mult=mult, **opts)
    run_adamw(x, "ext", lr, grad_mult=mult, **opts)
    assert_all_close64(x, want)


@pytest.mark.parametrize("layout", ["odd", "many"])
@pytest.mark.parametrize("config", list(SGD_CONFIGS))
def test_sgd_float64_kernel_matches_reference(ext_device, gen, layout, config):
    x = make_inputs(layout_sizes(layout, gen), F64, ext_device, gen, optimizer="sgd")
    want = x.clone()
    run_sgd(want, "torch", 0.03, **SGD_CONFIGS[config])
    run_sgd(x, "ext", 0.03, **SGD_CONFIGS[config])
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


def test_grad_mult_and_lr_tensor_scale_like_their_values(device, backend, gen):
    """grad_mult multiplies the grads and lr_tensor the rate: SGD by lr * m * g, exactly for powers of 2."""
    x = make_inputs([513, 65537], F32, device, gen, optimizer="sgd")
    want = [p - 0.25 * 0.5 * g for p, g in zip(x.params, x.grads, strict=True)]
    sgd_step_(x.params, x.grads, lr=torch.full((), 0.5, device=device), grad_mult=torch.full((), 0.25, device=device),
              backend=backend)  # fmt: skip
    for got, w in zip(x.params, want, strict=True):
        assert torch.equal(got, w)


# ---- found_inf: nothing written ------------------------------------------------------------------


@pytest.mark.parametrize("op", ["adamw", "sgd"])
@pytest.mark.parametrize("mode", ["nearest", "master", "stochastic"])
def test_found_inf_skips_everything(device, backend, gen, op, mode):
    dtype = F32 if mode == "nearest" else torch.bfloat16
    x = make_inputs([5, 65537, 300], dtype, device, gen, grad_dtype=F32, optimizer=op, amsgrad=True,
                    masters=mode == "master")  # fmt: skip
    before = snapshot(x.all_tensors())
    found = torch.ones((), device=device)
    kw = {"found_inf": found, "mode": mode, "seed": 3}
    if op == "adamw":
        run_adamw(x, backend, 1e-2, amsgrad=True, **kw)
    else:
        run_sgd(x, backend, 0.1, momentum=0.9, **kw)
    assert_bits_unchanged(before, x.all_tensors(), "step inputs")
    found.zero_()  # the same call with the flag clear does step
    if op == "adamw":
        run_adamw(x, backend, 1e-2, amsgrad=True, **kw)
    else:
        run_sgd(x, backend, 0.1, momentum=0.9, **kw)
    assert not torch.equal(before[0], snapshot(x.params[:1])[0])


# ---- registration ---------------------------------------------------------------------------------


def opcheck_samples(device: str, gen: torch.Generator) -> list[tuple[str, tuple]]:
    def scalar(v: float) -> torch.Tensor:
        return torch.full((), v, device=device)

    f = make_inputs([7, 65537], F32, device, gen, amsgrad=True)
    b = make_inputs([9, 300], torch.bfloat16, device, gen, grad_dtype=F32, masters=True)
    s = make_inputs([9, 300], torch.float16, device, gen, grad_dtype=F32, optimizer="sgd", shared_step=True)
    adam_f = (f.params, f.grads, f.exp_avgs, f.exp_avg_sqs, f.max_exp_avg_sqs, [], f.steps, 1e-3, scalar(2.0),
              scalar(0.5), scalar(0.0), 0.9, 0.999, 1e-8, 0.01, False, 0, 0)  # fmt: skip
    adam_b = (b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, [], b.master_params, b.steps, 1e-3, None, None, None,
              0.9, 0.99, 1e-8, 0.0, True, 1, 0)  # fmt: skip
    sgd_s = (s.params, s.grads, s.exp_avgs, [], s.steps, 0.1, None, scalar(0.5), None, 0.9, 0.0, 0.01, True, False, 2,
             7)  # fmt: skip
    return [("adamw_step_", adam_f), ("adamw_step_", adam_b), ("sgd_step_", sgd_s)]


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_opcheck(ext_device, gen):
    for name, args in opcheck_samples(ext_device, gen):
        op = getattr(torch.ops.gradacc, name)
        written = {a.name for a in op.default._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert "params" in written and "grads" not in written
        torch.library.opcheck(op.default, args)


@pytest.mark.parametrize("name", ["adamw_step_", "sgd_step_"])
def test_op_is_registered_for_every_backend(ext_device, name):
    op = f"gradacc::{name}"
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


def test_ops_are_exported():
    assert gradacc_ext.ops.adamw_step_ is adamw_step_ and gradacc_ext.ops.sgd_step_ is sgd_step_
