"""Fast tests of the benchmark harness (gradacc_ext.benchmarking): the byte model,
the workload shapes, the timing loop, the tables, and that every implementation
the harness times computes the same result as the others."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gradacc_ext.benchmarking import impls as impls_mod
from gradacc_ext.benchmarking import report, runner, targets, timing, verify
from gradacc_ext.benchmarking.operations import OPERATIONS, parse_operations
from gradacc_ext.benchmarking.state import CLIP_ALONE_COEF, LOSS_SCALE, make_state, needs_params
from gradacc_ext.benchmarking.workloads import (
    HUGE_NUMEL,
    Workload,
    gpt2_small,
    gpt_1_3b,
    make_workload,
    parse_workloads,
    small_2000,
)

# Odd sizes, one tensor across a 65,536-element chunk boundary.
TINY = Workload("tiny", "test set", ((3, 5), (7,), (1,), (65537,), (33, 17)), 1.0)
FAST_TIMING = timing.TimingConfig(threshold=0.5, min_time_s=0.0, max_time_s=0.01)
NON_COMPILED = ("gradacc", "eager", "reference")


def gpt_numel(vocab: int, ctx: int, d: int, layers: int) -> int:
    # wte + wpe + per layer (qkv, proj, fc, fc-proj weights: 12 d^2; biases and 2 lns: 13 d) + ln_f
    return vocab * d + ctx * d + layers * (12 * d * d + 13 * d) + 2 * d


# ---- byte model ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, per_element",
    [
        ("acc_bf16", 10),
        ("acc_fp32", 12),
        ("tail", 18),
        ("norm", 4),
        ("clip", 8),
        ("tail_adamw", 46),
        ("unscale_fp32", 8),
        ("unscale_bf16", 4),
        ("unscale_fp16", 4),
    ],
)
def test_byte_model(key: str, per_element: int) -> None:
    op = OPERATIONS[key]
    assert op.bytes_per_element() == per_element
    assert op.bytes_moved(1001) == per_element * 1001


def test_parse_operations_rejects_unknown() -> None:
    assert [o.key for o in parse_operations("tail, norm")] == ["tail", "norm"]
    with pytest.raises(ValueError, match="operations"):
        parse_operations("tail,bogus")


# ---- workloads -----------------------------------------------------------------------------


def test_gpt2_small_is_124m_in_148_tensors() -> None:
    w = gpt2_small()
    assert w.num_tensors == 2 + 12 * 12 + 2
    assert w.numel == gpt_numel(50257, 1024, 768, 12) == 124_439_808
    assert w.shapes[:4] == ((50257, 768), (1024, 768), (768,), (768,))
    assert (768, 2304) in w.shapes and (3072, 768) in w.shapes and (768, 3072) in w.shapes


def test_gpt_1_3b_size() -> None:
    w = gpt_1_3b()
    assert w.num_tensors == 2 + 24 * 12 + 2
    assert w.numel == gpt_numel(50257, 2048, 2048, 24)
    assert 1.25e9 < w.numel < 1.4e9


def test_scaling_keeps_tensor_count_and_shrinks_dims() -> None:
    full, quarter = gpt2_small(), gpt2_small(0.25)
    assert quarter.num_tensors == full.num_tensors
    assert quarter.numel == gpt_numel(round(50257 * 0.25), 256, 192, 12)
    small = small_2000()
    assert small.num_tensors == 2000 and all(1 <= s[0] <= 4096 for s in small.shapes)
    assert small.shapes == small_2000().shapes  # fixed seed
    assert small_2000(0.25).num_tensors == 2000 and small_2000(0.25).numel < small.numel


def test_huge_exceeds_int32_and_cannot_scale() -> None:
    w = make_workload("huge")
    assert w.gpu_only and w.numel == HUGE_NUMEL > 2**31
    with pytest.raises(ValueError, match="cannot be scaled"):
        make_workload("huge", 0.5)


def test_parse_workloads() -> None:
    ws = parse_workloads("gpt2-small=0.5, small-2000,huge", default_scale=0.25)
    assert [(w.name, w.scale) for w in ws] == [("gpt2-small", 0.5), ("small-2000", 0.25), ("huge", 1.0)]
    for bad, msg in [("gpt3", "unknown workload"), ("gpt2-small=x", "must be a number"), ("gpt2-small=2", r"\(0, 1\]"),
                     ("", "names no workload")]:  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            parse_workloads(bad)


# ---- state and timing ----------------------------------------------------------------------


def test_state_is_random_and_clip_really_clips() -> None:
    s = make_state(TINY, OPERATIONS["tail_adamw"], "cpu", seed=3)
    assert all(b.abs().max() > 0 and b.dtype == torch.float32 for b in s.bufs)
    assert all(g.dtype == torch.bfloat16 and g.abs().max() > 0 for g in s.grads)
    assert all(p.grad is b for p, b in zip(s.params, s.bufs, strict=True))
    assert math.isclose(float(s.inv_scale), 1 / LOSS_SCALE)
    # "clip alone" must multiply (a coefficient >= 1 is skipped by the kernels), and only a little.
    coef = s.max_norm / (float(s.clip_norm) + 1e-6)
    assert coef < 1 and math.isclose(coef, CLIP_ALONE_COEF, rel_tol=1e-5)
    assert needs_params(OPERATIONS["tail"], ("eager",)) and not needs_params(OPERATIONS["tail"], ("gradacc",))
    assert needs_params(OPERATIONS["tail_adamw"], ("gradacc",)) and not needs_params(OPERATIONS["acc_bf16"])
    norm_only = make_state(TINY, OPERATIONS["norm"], "cpu", seed=3)
    assert norm_only.grads == [] and norm_only.params == [] and norm_only.optimizer is None


def test_params_that_only_hold_grads_take_no_memory() -> None:
    """torch's clipping (eager tail and clip) reads only p.grad: without an optimizer the params are
    zero-stride views of one element, and restore() leaves them alone (they cannot be written)."""
    s = make_state(TINY, OPERATIONS["clip"], "cpu", seed=4, with_params=True)
    assert len(s.params) == TINY.num_tensors and all(p.grad is b for p, b in zip(s.params, s.bufs, strict=True))
    assert {p.untyped_storage().nbytes() for p in s.params} == {4}
    s.snapshot()
    before = [b.clone() for b in s.bufs]
    torch.nn.utils.clip_grads_with_norm_(s.params, s.max_norm, s.clip_norm, foreach=True)
    assert not all(torch.equal(a, b) for a, b in zip(before, s.bufs, strict=True))
    s.restore()
    assert all(torch.equal(a, b) for a, b in zip(before, s.bufs, strict=True))


def test_sets_needed_exceed_the_cache() -> None:
    cpu = torch.device("cpu")
    total = timing.rotation_bytes(cpu)
    assert total >= 8 * timing.cache_bytes(cpu) and total >= 1 << 28
    assert timing.sets_needed(total // 2, cpu) == 2
    assert timing.sets_needed(total // 2 - 1, cpu) == 3
    assert timing.sets_needed(total, cpu) == 1
    assert timing.sets_needed(1, cpu) == timing.MAX_SETS


# ---- verification --------------------------------------------------------------------------


def test_group_error() -> None:
    a = torch.tensor([1.0, -2.0, math.inf, math.nan])
    assert verify.group_error([a], [a.clone()]) == 0.0
    b = a.clone()
    b[1] = -2.5
    assert verify.group_error([a], [b]) == pytest.approx(0.5 / 2.0)
    c = a.clone()
    c[3] = 1.0  # NaN expected, a number produced
    assert verify.group_error([a], [c]) == math.inf
    assert verify.group_error([a], [a[:2]]) == math.inf
    assert verify.output_error({"x": [a]}, {"y": [a]}) == math.inf


@pytest.mark.parametrize("key", list(OPERATIONS))
def test_every_implementation_computes_the_same(key: str) -> None:
    op = OPERATIONS[key]
    results = {}
    for name in NON_COMPILED:
        state = make_state(TINY, op, "cpu", seed=11)  # identical inputs for every implementation
        results[name] = state.outputs(impls_mod.build_impl(name, op)(state))
    for name in NON_COMPILED[:-1]:
        assert verify.output_error(results["reference"], results[name]) < 1e-5, name


def test_tail_matches_float64_by_hand() -> None:
    op = OPERATIONS["tail"]
    state = make_state(TINY, op, "cpu", seed=5)
    acc = [(b.double() + g.double()) / LOSS_SCALE for b, g in zip(state.bufs, state.grads, strict=True)]
    norm = torch.cat([a.reshape(-1) for a in acc]).norm()
    coef = min(1.0, state.max_norm / (float(norm) + 1e-6))
    assert coef < 1  # the benchmark data must make the tail clip
    for name in NON_COMPILED:
        s = make_state(TINY, op, "cpu", seed=5)
        returned = impls_mod.build_impl(name, op)(s)
        assert float(returned.reshape(())) == pytest.approx(float(norm), rel=1e-5), name
        assert verify.group_error([a * coef for a in acc], s.bufs) < 1e-6, name
        assert float(s.found_inf) == 0.0


def test_every_implementation_flags_an_inf() -> None:
    op = OPERATIONS["tail"]
    for name in NON_COMPILED:
        s = make_state(TINY, op, "cpu", seed=7)
        s.grads[3][100] = math.inf
        impls_mod.build_impl(name, op)(s)
        assert float(s.found_inf) == 1.0, name


@pytest.mark.parametrize("key", ["unscale_fp32", "unscale_bf16", "unscale_fp16"])
def test_unscale_alone_flags_an_inf_and_keeps_magnitudes(key: str) -> None:
    op = OPERATIONS[key]
    for name in NON_COMPILED:
        s = make_state(TINY, op, "cpu", seed=9)
        assert all(b.dtype == op.buf_dtype for b in s.bufs) and not s.grads
        before = [b.clone() for b in s.bufs]
        impls_mod.build_impl(name, op)(s)
        assert float(s.found_inf) == 0.0 and all(torch.equal(b, -a) for a, b in zip(before, s.bufs, strict=True))
        s.bufs[3][7] = math.nan
        impls_mod.build_impl(name, op)(s)
        assert float(s.found_inf) == 1.0, name


def test_compiled_norm_matches() -> None:
    op = OPERATIONS["norm"]
    small = Workload("two", "test set", ((5, 3), (9,)), 1.0)
    state = make_state(small, op, "cpu", seed=1)
    expected = state.outputs(impls_mod.build_impl("reference", op)(state))
    got = state.outputs(impls_mod.build_impl("compile", op)(state))
    assert verify.output_error(expected, got) < 1e-5


# ---- runner, targets and tables ------------------------------------------------------------


@pytest.fixture
def small_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Input sets of 4 MiB in all: the cells' logic, without building hundreds of MiB per cell."""
    monkeypatch.setattr(timing, "rotation_bytes", lambda device, cache_multiple=8: 4 << 20)


def test_mismatching_implementation_is_not_timed(monkeypatch: pytest.MonkeyPatch, small_sets: None) -> None:
    real = impls_mod.build_impl

    def wrong_eager(name: str, op):
        impl = real(name, op)
        if name != "eager":
            return impl
        return lambda s: (impl(s), torch._foreach_mul_(s.bufs, 2.0))[0]  # computes something else

    monkeypatch.setattr(runner, "build_impl", wrong_eager)
    config = runner.BenchConfig("cpu", [TINY], parse_operations("acc_fp32"), NON_COMPILED, FAST_TIMING, 1 << 20)
    rows = {r["impl"]: r for r in runner.run_cell(TINY, OPERATIONS["acc_fp32"], config, lambda _: None)}
    assert rows["eager"]["status"].startswith("MISMATCH") and "median_s" not in rows["eager"]
    assert rows["gradacc"]["status"] == "ok" and rows["gradacc"]["median_s"] > 0
    assert rows["gradacc"]["gbps"] == pytest.approx(rows["gradacc"]["bytes"] / rows["gradacc"]["median_s"] / 1e9)


def test_run_and_write(tmp_path, small_sets: None) -> None:
    config = runner.BenchConfig("cpu", [TINY], parse_operations("acc_bf16,tail"), NON_COMPILED, FAST_TIMING, 1 << 20)
    results = runner.run(config, log=lambda _: None)
    paths = report.write(results, tmp_path)
    assert [p.suffix for p in paths] == [".json", ".md", ".png"]
    assert all(p.stat().st_size > 0 for p in paths)
    stem = paths[0].name.removesuffix(".json")
    assert [p.name for p in paths] == [stem + ".json", stem + ".md", stem + ".png"]
    assert "_cpu_torch" in stem and stem.split("_")[-1] == results["meta"]["commit"][:8]
    saved = json.loads(paths[0].read_text())
    assert {c["impl"] for c in saved["cells"]} == set(NON_COMPILED) and saved["targets"]
    text = paths[1].read_text()
    result_rows = [line for line in text.splitlines() if line.startswith(("| tiny | acc_bf16 |", "| tiny | tail |"))]
    assert len(result_rows) == 2 * len(NON_COMPILED)
    assert all(row.count("|") == 13 for row in result_rows)  # 12 columns each
    roofline = saved["copy"]["gbps"]
    samples = saved["copy"]["samples"]
    assert roofline == max(max(s.values()) for s in samples) and len(samples) == 1 + 2  # start, then after each cell
    timed = [c for c in saved["cells"] if "median_s" in c]
    for c in timed:  # a % above 100 would mean the roofline missed the machine's best moment: not shown
        pct = 100 * c["gbps"] / roofline
        assert c["pct_copy"] == (pytest.approx(pct) if pct <= 100 else None)
    assert all(("> roofline" in row) == (c["pct_copy"] is None) for row, c in zip(result_rows, timed, strict=True))
    assert "torch " + torch.__version__ in text and results["meta"]["commit"] in text


def fake_results(device: str, medians: dict[tuple[str, str, str], float], **extra) -> dict:
    cells = []
    for (w, op, impl), median in medians.items():
        cells.append({"workload": w, "op": op, "impl": impl, "median_s": median, "gbps": 1.0, "pct_copy": 90.0,
                      "launches": 2, "host_sync": "none", "first_call_s": 0.1, "status": "ok", **extra})  # fmt: skip
    return {
        "meta": {"device": device},
        "workloads": [{"name": "gpt2-small", "tensors": 148}],
        "operations": {k: {"ours": op.ours} for k, op in OPERATIONS.items()},
        "cells": cells,
    }


def test_cpu_targets_met_and_missed() -> None:
    medians = {("gpt2-small", "tail", "gradacc"): 1.0, ("gpt2-small", "tail", "reference"): 2.0,
               ("gpt2-small", "norm", "gradacc"): 1.0, ("gpt2-small", "norm", "reference"): 1.2}  # fmt: skip
    got = {(t["target"].split(":")[0], t["status"]) for t in targets.evaluate(fake_results("cpu", medians))}
    assert ("tail", "met") in got and ("norm", "missed") in got and ("clip", "n/a (not run)") in got
    assert not any(t["target"].startswith("tail_adamw") for t in targets.evaluate(fake_results("cpu", medians)))


def test_gpu_targets() -> None:
    medians = {("gpt2-small", "acc_bf16", "gradacc"): 1.0, ("gpt2-small", "acc_bf16", "eager"): 2.9,
               ("gpt2-small", "tail", "gradacc"): 1.0, ("gpt2-small", "tail", "compile"): 1.3}  # fmt: skip
    got = {t["target"]: t["status"] for t in targets.evaluate(fake_results("cuda", medians))}
    assert got["acc_bf16: speedup vs eager"] == "missed"  # 2.9x < 3x
    assert got["tail: speedup vs torch.compile"] == "met"
    assert got["acc_bf16: % of copy bandwidth"] == "met"
    assert got["tail: device launches"] == "met"
    assert got["tail: host syncs (sync_debug_mode='error')"] == "met"
    assert got["tail: speedup vs eager"] == "n/a (not run)"


def test_skipped_cells_are_reported_not_run(small_sets: None) -> None:
    fake_huge = Workload("fake-huge", "gpu-only stand-in", ((10,),), 1.0, gpu_only=True)
    config = runner.BenchConfig("cpu", [fake_huge], parse_operations("tail_adamw"), NON_COMPILED, FAST_TIMING, 1 << 20)
    rows = runner.run_cell(fake_huge, OPERATIONS["tail_adamw"], config, lambda _: None)
    assert all(r["status"].startswith("skipped") and "median_s" not in r for r in rows)
    rows = runner.run_cell(fake_huge, OPERATIONS["norm"], config, lambda _: None)
    status = {r["impl"]: r["status"].split(":")[0] for r in rows}
    assert status == {"gradacc": "ok", "eager": "skipped", "reference": "ok"}
    limited = runner.BenchConfig("cpu", [TINY], parse_operations("norm"), ("gradacc", "compile"), FAST_TIMING, 1 << 20,
                                 compile_max_tensors=TINY.num_tensors - 1)  # fmt: skip
    rows = {r["impl"]: r for r in runner.run_cell(TINY, OPERATIONS["norm"], limited, lambda _: None)}
    assert rows["compile"]["status"].startswith("skipped: compile") and rows["gradacc"]["median_s"] > 0
