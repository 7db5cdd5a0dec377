"""Low-bit optimizer states at the op level (issue 30, LOWBIT_SPEC.md): bf16 states with stochastic rounding
and int8 blockwise-quantized states, for adamw_step_, sgd_step_ and lion_step_.

The C++ CPU kernel equals the reference bit for bit over several steps (odd sizes with partial last blocks,
a chunk boundary, many tensors, unaligned storage); the int8 path equals a float64 run of the same algorithm
within one code; bf16 stochastic rounding is unbiased; a skipped step writes nothing.
"""

from __future__ import annotations

import pytest
import torch
from _devices import require_ext
from _lowbit_inputs import LowbitInputs, assert_same_as_reference, lowbit_inputs, new_grads, to_device
from _optim_inputs import BY_NAME, OptimInfo, row_configs
from _oracle import assert_bits_unchanged, small_sizes, snapshot

from gradacc_ext.ops import reference_optim, sgd_step_

SIZES = [1, 255, 256, 257, 1000, 65536 + 300]  # partial blocks, a block boundary, a chunk boundary
# Every config of the table but plain SGD (no state); int8 refuses amsgrad (tests/ops/test_optim_lowbit_errors.py).
ROWS = [r for r in row_configs() if r.id != "sgd-plain"]
INT8_ROWS = [r for r in ROWS if not r.values[0].configs[r.values[1]].get("amsgrad")]
STORAGE_ROWS = [pytest.param(*r.values, "bf16", id=f"{r.id}-bf16") for r in ROWS] + [
    pytest.param(*r.values, "int8", id=f"{r.id}-int8") for r in INT8_ROWS
]


def _options(info: OptimInfo, config: str) -> dict:
    return dict(info.configs[config])  # amsgrad (AdamW's) picks max_exp_avg_sqs: the inputs hold them


def _run_steps(inputs: LowbitInputs, info: OptimInfo, config: str, backend: str, grads: list, **kw) -> None:
    for step_grads in grads:
        for g, new in zip(inputs.x.grads, step_grads, strict=True):
            g.copy_(new)
        inputs.call(info, backend, info.lr, **_options(info, config), **kw)


def _compare_backends(inputs: LowbitInputs, info: OptimInfo, config: str, gen: torch.Generator, **kw) -> None:
    grads = [new_grads(inputs.x, gen) for _ in range(3)]
    ref = inputs.clone()
    _run_steps(inputs, info, config, "ext", grads, **kw)
    _run_steps(ref, info, config, "torch", grads, **kw)
    assert_same_as_reference(inputs, ref, info)


@pytest.mark.parametrize(("info", "config", "storage"), STORAGE_ROWS)
def test_cpu_kernel_equals_reference_bitwise(gen, info, config, storage):
    """Three steps with fresh grads: params, codes or bf16 states, scales and steps equal bit for bit."""
    require_ext("cpu")
    _compare_backends(lowbit_inputs(info, info.configs[config], SIZES, storage, gen), info, config, gen)


@pytest.mark.parametrize("storage", ["bf16", "int8"])
@pytest.mark.parametrize("mode", ["stochastic", "master"])
@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_bf16_params_with_lowbit_states(gen, name, mode, storage):
    """16-bit params (stochastic rounding draws beside the bf16 states' own; master weights) on both backends."""
    require_ext("cpu")
    info = BY_NAME[name]
    config = "momentum" if name == "sgd" else "plain"
    inputs = lowbit_inputs(info, info.configs[config], [300, 70000], storage, gen, param_dtype=torch.bfloat16)
    if mode == "master":
        inputs.x.master_params = [p.float() for p in inputs.x.params]
    _compare_backends(inputs, info, config, gen, mode=mode, seed=11)


@pytest.mark.parametrize("layout", ["aligned", "unaligned"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_int8_adamw_with_16_bit_grads(gen, ext_device, dtype, layout):
    """int8 AdamW with 16-bit params and grads, three steps on the device's kernel against the reference on the CPU.
    CUDA takes two quantization blocks per warp iteration there (optim_step.cuh's kQuantBlocksPerStep): 512 elements
    are one pair, 300, 1000 and 70000 leave an odd whole block and a partial one to the strided layout, which the
    unaligned lists take throughout."""
    info = BY_NAME["adamw"]
    ref = lowbit_inputs(info, {}, [300, 512, 1000, 70000], "int8", gen, param_dtype=dtype,
                        unaligned=layout == "unaligned")  # fmt: skip
    inputs = to_device(ref, ext_device)
    grads = [new_grads(ref.x, gen) for _ in range(3)]
    _run_steps(inputs, info, "plain", "ext", [[g.to(ext_device) for g in step] for step in grads])
    _run_steps(ref, info, "plain", "torch", grads)
    assert_same_as_reference(to_device(inputs, "cpu"), ref, info)


@pytest.mark.parametrize("storage", ["bf16", "int8"])
@pytest.mark.parametrize(("info", "config"), [r for r in INT8_ROWS if r.id in ("adamw-plain", "sgd-momentum")])
def test_many_tensors_and_unaligned_storage(gen, info, config, storage):
    require_ext("cpu")
    sizes = small_sizes(gen, count=300, high=700)
    inputs = lowbit_inputs(info, info.configs[config], sizes, storage, gen, unaligned=True)
    assert inputs.x.exp_avgs[0].data_ptr() % 16 != 0
    _compare_backends(inputs, info, config, gen)


@pytest.mark.parametrize(("info", "config"), INT8_ROWS)
@pytest.mark.parametrize("first_step", [False, True])
def test_int8_equals_float64_run_of_the_algorithm(gen, info, config, first_step):
    """One step of the CPU kernel against the reference computing in float64 (decode, update, absmax, encode):
    every code within one step, every scale within a few float32 roundings, params close. The first step starts from
    a fresh state (codes and scales all 0)."""
    require_ext("cpu")
    inputs = lowbit_inputs(info, info.configs[config], SIZES, "int8", gen, first_step=first_step)
    if first_step:
        for lists in (*inputs.slots(), *inputs.scales):
            for t in lists:
                t.zero_()
    oracle = inputs.clone()
    getattr(torch.ops.gradacc, info.op)(*inputs.record(info, _options(info, config), info.lr).args())
    getattr(reference_optim, info.op)(oracle.record(info, _options(info, config), info.lr), compute=torch.float64)
    for s, lists in enumerate(inputs.scales):
        for got, want in zip(lists, oracle.scales[s], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)  # a few float32 roundings
        for got, want in zip(inputs.slots()[s], oracle.slots()[s], strict=True):
            diff = (got.int() - want.int()).abs()
            assert int(diff.max()) <= 1, f"slot {s}: codes differ by {int(diff.max())}"
    for got, want in zip(inputs.x.params, oracle.x.params, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["ext", "torch"])
def test_bf16_state_rounding_is_unbiased(backend):
    """SGD's first step stores the momentum buffer = grad: one float32 value x between two bf16 neighbours,
    in 2**17 elements, each with its own draw. Their mean is x within 5 standard errors, and both neighbours
    occur; round-to-nearest would miss x by far more than that."""
    if backend == "ext":
        require_ext("cpu")
    n, x = 1 << 17, 1.0 + 0.3 * 2.0**-7  # bf16's ulp at 1 is 2**-7: up with probability 0.3
    down, up = 1.0, 1.0 + 2.0**-7
    p = (x - down) / (up - down)
    buffers = [torch.zeros(n, dtype=torch.bfloat16)]
    sgd_step_([torch.ones(n)], [torch.full((n,), x)], lr=0.0, momentum=0.9, momentum_buffers=buffers,
              steps=[torch.zeros(())], seed=5, backend=backend)  # fmt: skip
    stored = buffers[0].double()
    assert set(stored.unique().tolist()) == {down, up}
    standard_error = (p * (1 - p)) ** 0.5 * (up - down) / n**0.5
    assert abs(float(stored.mean()) - x) < 5 * standard_error
    assert abs(float(torch.tensor(x).to(torch.bfloat16)) - x) > 100 * standard_error  # nearest would fail


@pytest.mark.parametrize("backend", ["ext", "torch"])
@pytest.mark.parametrize("storage", ["bf16", "int8"])
@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_skipped_step_writes_nothing(gen, backend, storage, name):
    """found_inf = 1: params, poisoned codes (random bytes), scales and steps keep their bytes."""
    if backend == "ext":
        require_ext("cpu")
    info = BY_NAME[name]
    config = "momentum" if name == "sgd" else "plain"
    inputs = lowbit_inputs(info, info.configs[config], SIZES[:5], storage, gen)
    for lists in inputs.slots():
        for t in lists:
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen))
    before = snapshot(inputs.all_tensors())
    inputs.call(info, backend, info.lr, **_options(info, config), found_inf=torch.ones(()))
    assert_bits_unchanged(before, inputs.all_tensors(), "lowbit inputs")


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("storage", ["bf16", "int8"])
@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_opcheck_with_lowbit_states(gen, name, storage):
    """The schema's alias sets (scales written), the fake kernel and the registration agree with the kernel."""
    require_ext("cpu")
    info = BY_NAME[name]
    config = "momentum" if name == "sgd" else "plain"
    inputs = lowbit_inputs(info, info.configs[config], [9, 300], storage, gen)
    op = getattr(torch.ops.gradacc, info.op)
    written = {a.name for a in op.default._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert set(inputs.scales_kwargs(info)) <= written
    torch.library.opcheck(op.default, inputs.record(info, info.configs[config], 1e-3).args())
