"""Host emulation of the low-bit optimizer states (issue 30, LOWBIT_SPEC.md), run in CI without a GPU: evidence,
not GPU verification.

The CUDA kernel's bf16-state path (stochastic rounding from each slot's own draws) and its int8 path (one warp per
256-element quantization block: aligned blocks with 64-bit code and 16-byte list accesses, the strided layout for
unaligned lists and partial last blocks, the warp's shuffle absmax, the shared-memory code books) run through the
shim over several steps with fresh grads. Each result equals the reference (gradacc_ext.ops.reference_optim) bit
for bit, AdamW's params within a few ulps as the CPU kernel's do (tests/ops/test_optim_lowbit.py), and the C++
CPU kernel bit for bit, params included (the same element math).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _emulation import HAS_CPU_KERNELS, MARKS, Emulator
from _lowbit_inputs import LowbitInputs, assert_same_as_reference, lowbit_inputs, new_grads, unaligned_copy
from _optim_inputs import BY_NAME, OptimInfo, row_configs
from _oracle import assert_bits_unchanged, bits, small_sizes, snapshot

from gradacc_ext.ops import reference_optim

pytestmark = MARKS

SIZES = [1, 255, 256, 257, 1000, 65536 + 300]  # partial blocks, a block boundary, a chunk boundary
ROWS = [r for r in row_configs() if r.id != "sgd-plain"]  # plain SGD has no state
STEPS = 2


def _options(info: OptimInfo, config: str) -> dict:
    return dict(info.configs[config])


def _run(target, inputs: LowbitInputs, info: OptimInfo, config: str, grads: list, mode: str, seed: int) -> None:
    """STEPS steps on target: the Emulator, "cpu" (the C++ kernel through the op) or "ref" (the reference)."""
    for step_grads in grads:
        for g, new in zip(inputs.x.grads, step_grads, strict=True):
            g.copy_(new)
        a = inputs.record(info, _options(info, config), info.lr, mode, seed)
        if isinstance(target, Emulator):
            target.step(a)
        elif target == "cpu":
            getattr(torch.ops.gradacc, a.NAME)(*a.args())
        else:
            getattr(reference_optim, a.NAME)(a)


def run_and_check(emu: Emulator, inputs: LowbitInputs, info: OptimInfo, config: str, gen: torch.Generator,
                  mode: str = "nearest", seed: int = 0) -> None:  # fmt: skip
    grads = [new_grads(inputs.x, gen) for _ in range(STEPS)]
    ref, cpu = inputs.clone(), inputs.clone()
    _run(emu, inputs, info, config, grads, mode, seed)
    _run("ref", ref, info, config, grads, mode, seed)
    assert_same_as_reference(inputs, ref, info)
    if HAS_CPU_KERNELS:
        _run("cpu", cpu, info, config, grads, mode, seed)
        for i, (g, w) in enumerate(zip(inputs.all_tensors(), cpu.all_tensors(), strict=True)):
            assert torch.equal(bits(g), bits(w)), f"tensor {i} ({g.dtype}, {list(g.shape)}) differs from the CPU's"


@pytest.mark.parametrize(("info", "config"), ROWS)
@pytest.mark.parametrize("storage", ["bf16", "int8"])
@pytest.mark.parametrize("layout", ["aligned", "unaligned"])
def test_lowbit_steps(emulators, gen, info, config, storage, layout):
    """Every config of the table (int8: but amsgrad, refused), aligned lists (int8: the contiguous blocks, a
    partial last block strided) and lists off 16-byte alignment (every block strided)."""
    if storage == "int8" and info.configs[config].get("amsgrad"):
        pytest.skip("int8 refuses amsgrad (tests/ops/test_optim_lowbit_errors.py)")
    inputs = lowbit_inputs(info, info.configs[config], SIZES, storage, gen, unaligned=layout == "unaligned")
    run_and_check(emulators["param32k"], inputs, info, config, gen)


@pytest.mark.parametrize("storage", ["bf16", "int8"])
@pytest.mark.parametrize("mode", ["stochastic", "master"])
@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_bf16_params_with_lowbit_states(emulators, gen, name, mode, storage):
    """bf16 params with bf16 grads: stochastic rounding (its draws beside the bf16 states' own) or fp32 master
    weights (int8 AdamW: two quantization blocks per warp iteration, optim_step.cuh's kQuantBlocksPerStep)."""
    info = BY_NAME[name]
    config = "momentum" if name == "sgd" else "plain"
    inputs = lowbit_inputs(info, info.configs[config], [300, 70000], storage, gen, param_dtype=torch.bfloat16)
    if mode == "master":
        inputs.x.master_params = [p.float() for p in inputs.x.params]
    run_and_check(emulators["param32k"], inputs, info, config, gen, mode=mode, seed=11)


@pytest.mark.parametrize("mode", ["nearest", "stochastic", "master"])
def test_bf16_params_with_fp32_grads_and_int8_states(emulators, gen, mode):
    """bf16 params with fp32 grads (the accumulator's buffers): int8 AdamW takes one quantization block per warp
    iteration there."""
    info = BY_NAME["adamw"]
    inputs = lowbit_inputs(info, {}, [300, 70000], "int8", gen, param_dtype=torch.bfloat16, grad_dtype=torch.float32)
    if mode == "master":
        inputs.x.master_params = [p.float() for p in inputs.x.params]
    run_and_check(emulators["param32k"], inputs, info, "plain", gen, mode=mode, seed=11)


@pytest.mark.parametrize("layout", ["aligned", "unaligned"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_int8_adamw_with_16_bit_grads(emulators, gen, dtype, layout):
    """int8 AdamW with 16-bit params and grads: a warp takes two whole quantization blocks per iteration (their
    loads first), the whole block left over by an odd count and a partial last block go strided (512: one pair;
    300, 1000 and the second chunk of 70000: an odd count of whole blocks and a partial one); unaligned lists
    go strided throughout."""
    info = BY_NAME["adamw"]
    inputs = lowbit_inputs(info, {}, [300, 512, 1000, 70000], "int8", gen, param_dtype=dtype,
                           unaligned=layout == "unaligned")  # fmt: skip
    run_and_check(emulators["param32k"], inputs, info, "plain", gen)


@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_int8_fresh_state(emulators, gen, name):
    """The first step from a fresh int8 state (codes and scales all 0: every code decodes to 0)."""
    info = BY_NAME[name]
    config = "momentum" if name == "sgd" else "plain"
    inputs = lowbit_inputs(info, info.configs[config], SIZES, "int8", gen, first_step=True)
    for lists in (*inputs.slots(), *inputs.scales):
        for t in lists:
            t.zero_()
    run_and_check(emulators["param32k"], inputs, info, config, gen)


@pytest.mark.parametrize("offset", [1, 8])
def test_int8_codes_alone_off_alignment(emulators, gen, offset):
    """Codes 1 byte off 8-byte alignment send their chunks down the strided layout (the shim reports a
    misaligned 64-bit access as a launch error); 8 bytes off 16 still take the 64-bit code accesses."""
    info = BY_NAME["adamw"]
    inputs = lowbit_inputs(info, {}, [4096, 65536 + 512], "int8", gen)
    for lists in inputs.slots()[:2]:
        for i, t in enumerate(lists):
            lists[i] = torch.empty(t.numel() + offset, dtype=t.dtype)[offset:].view(t.shape).copy_(t)
    assert inputs.x.exp_avgs[0].data_ptr() % 8 == offset % 8
    run_and_check(emulators["param32k"], inputs, info, "plain", gen)


@pytest.mark.parametrize("storage", ["bf16", "int8"])
@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_skipped_step_writes_nothing(emulators, gen, name, storage):
    """found_inf = 1: params, poisoned states (random bytes), scales and steps keep their bytes."""
    info = BY_NAME[name]
    config = "momentum" if name == "sgd" else "plain"
    inputs = lowbit_inputs(info, info.configs[config], SIZES[:5], storage, gen)
    for lists in inputs.slots():
        for t in lists:
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen))
    before = snapshot(inputs.all_tensors())
    emulators["param32k"].step(replace(inputs.record(info, _options(info, config), info.lr), found_inf=torch.ones(())))
    assert_bits_unchanged(before, inputs.all_tensors(), "lowbit inputs")


@pytest.mark.parametrize(("variant", "name", "count"), [("param4k", "sgd", 60), ("param32k", "lion", 330)])
def test_int8_many_tensors_over_several_launches(emulators, gen, variant, name, count):
    """More tensors than one launch's int8 metadata holds (10 lists: 313 per 32 KB launch, 38 per 4 KB),
    unaligned ones among them."""
    emu, info = emulators[variant], BY_NAME[name]
    assert count > emu.capacity(10)
    config = "momentum" if name == "sgd" else "plain"
    inputs = lowbit_inputs(info, info.configs[config], small_sizes(gen, count, 700), "int8", gen)
    inputs.x.params[1::3] = [unaligned_copy(p) for p in inputs.x.params[1::3]]
    run_and_check(emu, inputs, info, config, gen, mode="nearest")
