"""Host emulation of the CUDA device code, run in CI without a GPU: evidence, not GPU verification.

tests/emulation/emu_build.py compiles the real csrc/kernels/*.cuh and csrc/cuda/kernels.cu with g++
against a shim (tests/emulation/shim/cuda_runtime_api.h) that runs each block's 512 threads as
fibers with real barriers and warp shuffles. The launchers, the chunking, the by-value metadata
(both the 32 KB and the 4 KB parameter variants), the vector/scalar paths and the reductions run
as written; results are compared with the float64 oracle and, element by element, bit for bit with
the C++ CPU kernels (the same element math). Nothing here says anything about timing, the memory
model or the compiled SASS: scripts/gpu_verify.sh is the GPU check. The norm and clip kernels (float64
lists included) are in test_emulation_norm_scale.py, the optimizer steps in test_emulation_optim.py.
"""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
from _emulation import HAS_CPU_KERNELS, MARKS, Emulator, assert_matches_cpu_kernels
from _oracle import (
    ODD_SIZES,
    assert_close_list,
    assert_norm_close,
    assert_per_tensor_norms,
    f64,
    name,
    rand_list,
    random_dtypes,
    small_sizes,
)

import gradacc_ext

pytestmark = MARKS

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
PAIRS = [(F32, F32), (F16, F32), (F16, F16), (BF16, F32), (BF16, BF16)]  # (grad, buffer)
LAYOUTS = ("odd", "unaligned")


# ---- the shim itself -------------------------------------------------------------------------


def test_shim_detects_a_divergent_barrier(emu: Emulator):
    out = torch.zeros(512, dtype=torch.int32)
    err = ctypes.create_string_buffer(512)
    rc = emu.lib.emu_selftest_divergent_barrier(ctypes.c_void_p(out.data_ptr()), 512, err, len(err))
    assert rc != 0 and b"never released" in err.value


def test_shim_detects_a_misaligned_vector_access(emu: Emulator):
    data, out = torch.ones(12), torch.zeros(1)  # torch's CPU allocations are 64-byte aligned
    for offset, ok in [(0, True), (4, True), (1, False), (2, False)]:
        err = ctypes.create_string_buffer(512)
        rc = emu.lib.emu_selftest_vector_load(ctypes.c_void_p(data.data_ptr()), offset, ctypes.c_void_p(out.data_ptr()),
                                               err, len(err))  # fmt: skip
        assert (rc == 0) == ok and (ok or b"misaligned 16-byte access" in err.value), (offset, err.value)


def test_shim_warp_shuffles_and_block_vote(emu: Emulator, gen: torch.Generator):
    blocks, threads = 3, 512
    x = torch.randn(blocks * threads, generator=gen).abs() + 0.5
    x[threads + 77] = -1.0  # block 1 alone has a negative value
    sums = torch.full((blocks * threads // 32,), math.nan)
    neg = torch.full((blocks,), -1, dtype=torch.int32)
    err = ctypes.create_string_buffer(512)
    p = [ctypes.c_void_p(t.data_ptr()) for t in (x, sums, neg)]
    assert emu.lib.emu_selftest_warp_sum(*p, blocks, threads, err, len(err)) == 0, err.value
    want = x.view(-1, 32).double().sum(1)
    assert torch.allclose(sums.double(), want, rtol=1e-6)
    assert neg.tolist() == [0, 1, 0]


# ---- accumulate_ / accumulate_final_ ---------------------------------------------------------

MODES = ("add", "assign_tensor", "final_l2", "final_inf_assign")


def make_lists(grad_dtype, buf_dtype, numels, gen, unaligned=False):
    grads = rand_list(numels, grad_dtype, "cpu", gen, unaligned=unaligned)
    bufs = rand_list(numels, buf_dtype, "cpu", gen, unaligned=unaligned)
    return bufs, grads


def run_accumulate(target, bufs, grads, mode, alpha, alpha_t, norm_start):
    """Runs `mode` on target (the Emulator, or "ext" for the CPU kernels); returns (found_inf, norm_acc)."""
    found, norm = torch.zeros(1), torch.full((), norm_start)
    assign = mode in ("assign_tensor", "final_inf_assign")
    a_t = alpha_t if mode == "assign_tensor" else None
    final = mode.startswith("final")
    norm_type = math.inf if mode == "final_inf_assign" else 2.0
    if isinstance(target, Emulator):
        target.accumulate_(bufs, grads, alpha, a_t, assign, (found, norm, norm_type) if final else None)
    elif final:
        gradacc_ext.accumulate_final_(bufs, grads, found, norm, alpha, assign=assign, norm_type=norm_type,
                                      backend="ext")  # fmt: skip
    else:
        gradacc_ext.accumulate_(bufs, grads, alpha_t * alpha if a_t is not None else alpha, assign=assign,
                                backend="ext")  # fmt: skip
    return found, norm


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("grad_dtype", "buf_dtype"), PAIRS, ids=[f"g{name(g)}-b{name(b)}" for g, b in PAIRS])
def test_accumulate(emu, gen, grad_dtype, buf_dtype, mode, layout):
    bufs, grads = make_lists(grad_dtype, buf_dtype, ODD_SIZES, gen, unaligned=layout == "unaligned")
    alpha = 0.25 + torch.rand((), generator=gen).item()
    alpha_t = torch.full((), 0.5 + torch.rand((), generator=gen).item())
    norm_start = 4.0  # an earlier bucket's partial: this call adds to it (sum of squares, or max)
    assign = mode in ("assign_tensor", "final_inf_assign")
    eff_alpha = alpha * (alpha_t.item() if mode == "assign_tensor" else 1.0)
    b64, g64 = f64(bufs), f64(grads)
    want = [(0 if assign else b) + eff_alpha * g for b, g in zip(b64, g64, strict=True)]
    mag = [(0 if assign else b.abs()) + (eff_alpha * g).abs() for b, g in zip(b64, g64, strict=True)]
    cpu_bufs = [b.clone() for b in bufs]

    found, norm = run_accumulate(emu, bufs, grads, mode, alpha, alpha_t, norm_start)

    assert_close_list(bufs, want, mag, 4, "bufs")
    if mode.startswith("final"):
        assert found.item() == 0.0
        l2 = mode == "final_l2"
        start = torch.full((1,), math.sqrt(norm_start) if l2 else norm_start)  # the partial it started from
        assert_norm_close(norm.sqrt() if l2 else norm, [*bufs, start], 2.0 if l2 else math.inf, "norm_acc")
    if HAS_CPU_KERNELS:
        cpu_found, _ = run_accumulate("ext", cpu_bufs, grads, mode, alpha, alpha_t, norm_start)
        assert_matches_cpu_kernels(bufs, cpu_bufs, "bufs vs CPU kernels")
        assert found.item() == cpu_found.item()


@pytest.mark.parametrize("which", ["bufs", "grads"])
def test_accumulate_with_one_list_misaligned(emu, gen, which):
    """Either list alone off 16-byte alignment sends the chunk down the scalar path (the shim reports
    a misaligned 16-byte access as a launch error)."""
    lists = dict(zip(("bufs", "grads"), make_lists(F16, F32, [8195, 65537], gen), strict=True))
    lists[which] = rand_list([t.numel() for t in lists[which]], lists[which][0].dtype, "cpu", gen, unaligned=True)
    bufs, grads = lists["bufs"], lists["grads"]
    want = [b + 0.5 * g for b, g in zip(f64(bufs), f64(grads), strict=True)]
    mag = [b.abs() + (0.5 * g).abs() for b, g in zip(f64(bufs), f64(grads), strict=True)]
    cpu_bufs = [b.clone() for b in bufs]
    emu.accumulate_(bufs, grads, 0.5)
    assert_close_list(bufs, want, mag, 2, "bufs")
    if HAS_CPU_KERNELS:
        gradacc_ext.accumulate_(cpu_bufs, grads, 0.5, backend="ext")
        assert_matches_cpu_kernels(bufs, cpu_bufs, "bufs vs CPU kernels")


def test_accumulate_final_flags_an_overflow(emu, gen):
    bufs, grads = make_lists(F16, F16, ODD_SIZES, gen)
    grads[5][65536 + 3] = 60000.0  # in tensor 5's second chunk: 2 * 60000 overflows fp16
    found, norm = torch.zeros(1), torch.zeros(())
    emu.accumulate_(bufs, grads, 2.0, final=(found, norm, 2.0))
    assert found.item() == 1.0 and math.isinf(norm.item())


# ---- many tensors: the metadata split over several launches ----------------------------------


@pytest.mark.parametrize(("variant", "count"), [("param32k", 1300), ("param4k", 400)])
def test_many_tensors_over_several_launches(emulators, gen, variant, count):
    """More tensors than one launch's metadata holds (32 KB: 1065 pairs / 1278 singles; the 4 KB
    variant for drivers without large kernel parameters: far fewer), mixed dtypes, a few empty and a
    few multi-chunk tensors."""
    emu = emulators[variant]
    assert count > emu.capacity(1) and count > emu.capacity(2)
    numels = small_sizes(gen, count, 90)
    numels[5], numels[count // 2], numels[-1] = 0, 70001, 0
    grad_dtypes = random_dtypes(gen, count)
    grads = [t for t in rand_list(numels, grad_dtypes, "cpu", gen)]
    bufs = rand_list(numels, F32, "cpu", gen)
    b64, g64 = f64(bufs), f64(grads)
    found, norm = torch.zeros(1), torch.zeros(())

    emu.accumulate_(bufs, grads, 0.5, final=(found, norm, 2.0))

    assert_close_list(bufs, [b + 0.5 * g for b, g in zip(b64, g64, strict=True)],
                      [b.abs() + (0.5 * g).abs() for b, g in zip(b64, g64, strict=True)], 3, "bufs")  # fmt: skip
    assert found.item() == 0.0
    assert_norm_close(norm.sqrt(), bufs, 2.0, "norm_acc")
    total, each = emu.global_norm(grads, 2.0, per_tensor=variant == "param4k")
    assert_norm_close(total, grads, 2.0, "global_norm")
    if variant == "param4k":
        assert_per_tensor_norms(each, grads, 2.0)
