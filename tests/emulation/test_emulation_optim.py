"""Host emulation of the fused optimizer steps (every row of the test table, _optim_inputs.OPTIMIZERS),
run in CI without a GPU: evidence, not GPU verification.

The g++ build of tests/emulation/test_emulation.py (the `emulators` fixture) also holds csrc/cuda/optim_kernels.cu
(optim_step.cuh over optim_traits.cuh); tests/emulation/emu_optim.cpp fills its params as the binding
does. Every case runs one optimizer step through the emulated launcher and compares
(a) with the float64 reference (gradacc_ext.ops.reference_optim on float64 copies) within bounds
    derived from the kernels' roundings, and
(b) bit for bit with the C++ CPU kernels (csrc/cpu/optim_cpu.cpp): the same element math, and
    stochastic rounding draws its bits from (seed, step, global element position) on every device,
    as README promises ("a run reproduces from its seed on any device").
Per-tensor constants (adam_consts: pow, sqrt in double) come from the host's libm here: a GPU's
double pow is not correctly rounded, so (b) is no evidence about those constants on a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from _emulation import HAS_CPU_KERNELS, MARKS, Emulator, assert_matches_cpu_kernels
from _optim_inputs import BY_NAME, OPTIMIZERS, OptimInfo, StepInputs, make_inputs, row_configs
from _oracle import ODD_SIZES, U32, assert_bitwise_equal, assert_close, name, small_sizes, snapshot

from gradacc_ext.ops import reference_optim
from gradacc_ext.ops.optim_args import OptimStep

pytestmark = MARKS

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
U64 = 2.0**-53
# (param, grad, mode): every dtype pair the kernel dispatches, each 16-bit pair in the three modes
CASES = [(F64, F64, "nearest"), (F64, F32, "nearest"), (F32, F32, "nearest")] + [
    (p, g, m) for p in (F16, BF16) for g in (p, F32) for m in ("nearest", "master", "stochastic")
]
CASE_IDS = [f"p{name(p)}-g{name(g)}-{m}" for p, g, m in CASES]
# Roundings (of the compute type) on the longest path to each param, counted in optim_traits.cuh:
# AdamW: 7 rounded constants, g * mult, lerp (3), v (4, halved by the sqrt), sqrt, / bc2, + eps,
# m / denom, * step_size, decay (2), the final add: <= 16. SGD: 5 constants, g * mult, decay (2),
# the buffer (3), nesterov (2), * -lr, the add: <= 12. Lion: 2 constants, g * mult, decay (2), the
# add (lr * sign is exact): <= 6. State: <= 8 each.
ROUNDINGS, STATE_ROUNDINGS = {"adamw": 16, "sgd": 12, "lion": 6}, 8


def options(i: int) -> dict:
    """The i-th mix of the secondary options, so that every case and config meets each of them:
    layout, which optional tensors are passed (lr_tensor, grad_mult, a clear found_inf), shared or
    per-param step counts, SGD's first step (its momentum buffer starts from the grad)."""
    return {"unaligned": i % 2 == 1, "lr_tensor": i % 3 != 0, "grad_mult": i % 3 != 1, "found_inf": i % 4 == 0,
            "shared_step": i % 5 == 2, "first_step": i % 4 == 3}  # fmt: skip


def scalar(gen: torch.Generator, low: float) -> torch.Tensor:
    return torch.full((), low + float(torch.rand((), generator=gen)))


def f64_copy(x: StepInputs) -> StepInputs:
    return StepInputs(*([t.to(F64, copy=True) for t in group] for group in (*x.lists(), x.steps)))


def run_step(target, a: OptimStep) -> None:
    """target: the Emulator, "cpu" (the C++ CPU kernels through the op) or "ref" (the reference)."""
    if isinstance(target, Emulator):
        target.step(a)
    elif target == "cpu":
        getattr(torch.ops.gradacc, a.NAME)(*a.args())
    else:
        getattr(reference_optim, a.NAME)(a)


def magnitudes(info: OptimInfo, x0: StepInputs, ref: StepInputs, i: int, opts: dict, lr: float, mult: float,
               unit: float) -> dict:  # fmt: skip
    """Sizes of the values rounded on the way to tensor i's results (float64 inputs x0, oracle ref;
    unit: the roundoff of the compute type)."""
    done = float(x0.steps[0 if len(x0.steps) == 1 else i]) if x0.steps else 0.0
    p0 = (x0.master_params or x0.params)[i].abs()
    g = x0.grads[i].abs() * abs(mult)
    if info.name == "adamw":
        b1, b2 = opts.get("betas", (0.9, 0.999))
        m = x0.exp_avgs[i].abs() + g  # lerp's difference
        second = (ref.max_exp_avg_sqs or ref.exp_avg_sqs)[i]
        denom = second.sqrt() / math.sqrt(1.0 - b2 ** (done + 1)) + opts.get("eps", 1e-8)
        return {"param": p0 + lr / (1.0 - b1 ** (done + 1)) * m / denom, "exp_avgs": m, "exp_avg_sqs": second}
    if info.name == "lion":
        b1 = opts.get("betas", (0.9, 0.99))[0]
        signed = x0.grads[i] * mult * (-1.0 if opts.get("maximize") else 1.0)
        size = b1 * x0.exp_avgs[i].abs() + (1 - b1) * g
        # where rounding may decide the sign of the interpolation, the param may move by 2 lr instead
        ambiguous = (b1 * x0.exp_avgs[i] + (1 - b1) * signed).abs() <= 8 * U32 * size
        slack = ambiguous * (2 * lr / (ROUNDINGS["lion"] * unit))
        return {"param": p0 + lr + slack, "exp_avgs": x0.exp_avgs[i].abs() + g}
    momentum = opts.get("momentum", 0.0)
    g = g + opts.get("weight_decay", 0.0) * p0
    if not momentum:
        return {"param": p0 + lr * g}
    buf = g if done == 0 else momentum * x0.exp_avgs[i].abs() + abs(1.0 - opts.get("dampening", 0.0)) * g
    direction = g + momentum * buf if opts.get("nesterov") else buf
    return {"param": p0 + lr * direction, "exp_avgs": buf}


def assert_step_close(got, want, mag, roundings: int, what: str, ulps: float = 0.5) -> None:
    if got.dtype == F64:
        err = (got - want).abs()
        bad = ~(err <= roundings * U64 * mag)
        assert not bad.any(), f"{what}: {int(bad.sum())} float64 elements out of bound, max error {float(err.max())}"
    else:
        assert_close(got, want, mag, roundings, what, ulps)


def check_oracle(info: OptimInfo, got: StepInputs, x0: StepInputs, ref: StepInputs, opts, lr, mult, mode) -> None:
    """(a): every result within its bound of the float64 reference; step counts exact."""
    roundings = ROUNDINGS[info.name]
    for i, p in enumerate(got.params):
        mag = magnitudes(info, x0, ref, i, opts, lr, mult, U64 if p.dtype == F64 else U32)
        if got.master_params:  # the master steps; the param is its rounding to nearest
            assert_step_close(got.master_params[i], ref.master_params[i], mag["param"], roundings, f"masters[{i}]")
            assert_bitwise_equal(p, got.master_params[i].to(p.dtype), f"params[{i}] vs its master")
        else:
            sr = mode == "stochastic" and p.dtype in (F16, BF16)
            assert_step_close(p, ref.params[i], mag["param"], roundings, f"params[{i}]", 1.0 if sr else 0.5)
        state = {"exp_avgs": (got.exp_avgs, ref.exp_avgs), "exp_avg_sqs": (got.exp_avg_sqs, ref.exp_avg_sqs)}
        if got.max_exp_avg_sqs:  # max(vmax, v) is exact: v's bound
            mag["max_exp_avg_sqs"] = mag["exp_avg_sqs"]
            state["max_exp_avg_sqs"] = (got.max_exp_avg_sqs, ref.max_exp_avg_sqs)
        for key, (g_list, w_list) in state.items():
            if key in mag:
                assert_step_close(g_list[i], w_list[i], mag[key], STATE_ROUNDINGS, f"{key}[{i}]")
    assert [float(s) for s in got.steps] == [float(s) for s in ref.steps]


def run_and_check(emu: Emulator, info: OptimInfo, x: StepInputs, opts: dict, lr: float, tensors: tuple, mode: str,
                  seed: int) -> None:  # fmt: skip
    """Runs the step on the emulation, the CPU kernels and the float64 reference from the same inputs."""
    x0, cpu = f64_copy(x), x.clone()
    ref = f64_copy(x)
    run_step(emu, info.record_of(x, opts, lr, tensors, mode, seed))
    run_step("ref", info.record_of(ref, opts, lr, tensors, mode, seed))
    lr_eff = lr * (float(tensors[0]) if tensors[0] is not None else 1.0)
    mult = float(tensors[1]) if tensors[1] is not None else 1.0
    check_oracle(info, x, x0, ref, opts, lr_eff, mult, mode)
    if HAS_CPU_KERNELS:  # (b)
        run_step("cpu", info.record_of(cpu, opts, lr, tensors, mode, seed))
        assert_matches_cpu_kernels(x.all_tensors(), cpu.all_tensors(), f"{info.op} vs CPU kernels")


@pytest.mark.parametrize(("info", "config"), row_configs())
@pytest.mark.parametrize("case", range(len(CASES)), ids=CASE_IDS)
def test_step(emulators, gen, case, info, config):
    param, grad, mode = CASES[case]
    opts = {"weight_decay": 0.02, **info.configs[config]} if info.name != "sgd" else info.configs[config]
    o = options(4 * case + list(info.configs).index(config))
    x = make_inputs(ODD_SIZES, param, "cpu", gen, grad_dtype=grad, optimizer=info.name,
                    amsgrad=bool(opts.get("amsgrad")), masters=mode == "master", unaligned=o["unaligned"],
                    shared_step=o["shared_step"], first_step=o["first_step"] and info.name == "sgd")  # fmt: skip
    tensors = (scalar(gen, 0.5) if o["lr_tensor"] else None, scalar(gen, 0.25) if o["grad_mult"] else None,
               torch.zeros(()) if o["found_inf"] else None)  # fmt: skip
    seed = int(torch.randint(0, 2**62, (), generator=gen))
    run_and_check(emulators["param32k"], info, x, opts, info.lr, tensors, mode, seed)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=lambda i: i.name)
@pytest.mark.parametrize("mode", ["nearest", "master", "stochastic"])
def test_found_inf_skips_everything(emulators, gen, info, mode):
    """A raised found_inf: no element, state, master or step count is written."""
    x = make_inputs([5, 65537, 300], BF16, "cpu", gen, grad_dtype=F32, optimizer=info.name, amsgrad=True,
                    masters=mode == "master")  # fmt: skip
    opts = {"adamw": {"amsgrad": True}, "sgd": {"momentum": 0.9}}.get(info.name, {})
    before = snapshot(x.all_tensors())
    run_step(emulators["param32k"], info.record_of(x, opts, 0.1, (None, None, torch.ones(())), mode, 3))
    for i, (b, t) in enumerate(zip(before, x.all_tensors(), strict=True)):
        assert torch.equal(b, snapshot([t])[0]), f"tensor {i} was written"


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of t one element past an allocation: off 16-byte alignment."""
    return torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape).copy_(t)


@pytest.mark.parametrize("which", ["params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "master_params"])
def test_one_list_misaligned(emulators, gen, which):
    """Any one of the six lists alone off 16-byte alignment sends the chunk down the scalar path
    (the shim reports a misaligned 16-byte access as a launch error)."""
    x = make_inputs([8195, 65537], BF16, "cpu", gen, grad_dtype=F32, amsgrad=True, masters=True)
    setattr(x, which, [misaligned(t) for t in getattr(x, which)])
    opts = {"amsgrad": True, "weight_decay": 0.1}
    run_and_check(emulators["param32k"], BY_NAME["adamw"], x, opts, 1e-2, (None, None, None), "master", 0)


def mixed_inputs(info: OptimInfo, count: int, gen: torch.Generator) -> StepInputs:
    """`count` small tensors of every param dtype (grads of the param's dtype or fp32), a few empty,
    one of three chunks: more than one launch's metadata."""
    sizes = small_sizes(gen, count, 90)
    sizes[3], sizes[count // 2], sizes[-1] = 0, 3 * 65536 + 5, 0
    dtypes = [(F32, F16, BF16, F64)[int(i)] for i in torch.randint(0, 4, (count,), generator=gen)]
    parts = [make_inputs([n], d, "cpu", gen, grad_dtype=F32 if j % 2 else d, optimizer=info.name, amsgrad=True)
             for j, (n, d) in enumerate(zip(sizes, dtypes, strict=True))]  # fmt: skip
    return StepInputs(*([t for part in parts for t in getattr(part, f)] for f in StepInputs.__dataclass_fields__))


@pytest.mark.parametrize(("variant", "name", "count"), [("param32k", "adamw", 500), ("param4k", "sgd", 530),
                                                       ("param32k", "lion", 450)])  # fmt: skip
def test_many_tensors_over_several_launches(emulators, gen, variant, name, count):
    """More tensors than one launch's metadata holds (7 lists: 426 per 32 KB launch, 52 per 4 KB),
    mixed dtypes, stochastic rounding (its positions count chunks across launches), per-param steps
    (the 4 KB variant also needs two launches of the step increments, 504 each). SGD: some params
    take their first step (the buffer starts from the grad), others not."""
    emu, info = emulators[variant], BY_NAME[name]
    assert count > emu.capacity(7) and (variant == "param32k" or count > emu.step_batch())
    x = mixed_inputs(info, count, gen)
    if name == "sgd":
        for s in x.steps[::3]:
            s.zero_()
    opts = {"adamw": {"amsgrad": True, "weight_decay": 0.01}, "sgd": {"momentum": 0.9, "nesterov": True},
            "lion": {"weight_decay": 0.1}}[name]  # fmt: skip
    run_and_check(emu, info, x, opts, 1e-2, (None, scalar(gen, 0.5), None), "stochastic", 12345)
