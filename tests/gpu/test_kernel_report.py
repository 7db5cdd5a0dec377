"""scripts/kernel_report.py's parts, each on its own: the SASS and ptxas-log parsing, the occupancy
arithmetic, the rules, the names; and scripts/gpu_verify_model.py's model check in gpu_verify's summary.
The compile itself runs in CI (scripts/quickstart.sh test), not here: it takes minutes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if not (ROOT / "scripts" / "kernel_report.py").exists():
    # A module-level skip: a skipif mark would still import the scripts below and fail the collection.
    pytest.skip("needs the source tree's scripts/ (CI's wheel run tests a copy of tests/)", allow_module_level=True)
sys.path.insert(0, str(ROOT / "scripts"))
from kernel_occupancy import ARCHS, max_registers_for, occupancy  # noqa: E402
from kernel_predictions import gpu_of  # noqa: E402
from kernel_report import launch_block_threads, problems_of, short_name  # noqa: E402
from kernel_sass import Resources, analyse, parse_ptxas_log, parse_sass  # noqa: E402

# Two kernels as `cuobjdump -sass` prints them (trimmed): a loop at 0x0040..0x00a0 holding a 128-bit
# load, a 64-bit load and a 16-bit load; a second loop with only 32-bit accesses; a spill.
SASS = """
Fatbin elf code:
================
arch = sm_90
\t\tFunction : _Z3vecv
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0040*/                   LDG.E.128 R8, desc[UR4][R2.64] ;
        /*0050*/              @!P0 LDG.E.64 R12, desc[UR4][R2.64] ;
        /*0060*/                   LDG.E.U16 R14, desc[UR4][R2.64] ;
        /*0070*/                   STG.E.128 desc[UR4][R2.64], R8 ;
        /*00a0*/               @P1 BRA 0x40 ;
        /*00b0*/                   LDG.E R5, desc[UR4][R2.64] ;
        /*00c0*/                   BRA 0xc0 ;
\t\tFunction : _Z6scalarv
        /*0000*/                   LDG.E R5, desc[UR4][R2.64] ;
        /*0010*/                   STL.64 [R1], R2 ;
        /*0020*/                   LDL.LU.64 R2, [R1] ;
        /*0030*/                   STG.E desc[UR4][R2.64], R5 ;
        /*0040*/               @P0 BRA 0x0 ;
"""
PTXAS = """ptxas info    : Compiling entry function '_Z3vecv' for 'sm_90'
ptxas info    : Function properties for _Z3vecv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 128 bytes smem
ptxas info    : Compiling entry function '_Z6scalarv' for 'sm_90'
ptxas info    : Function properties for _Z6scalarv
    8 bytes stack frame, 144 bytes spill stores, 144 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 8 bytes cumulative stack size
"""


def test_sass_counts_the_hot_loops_accesses_by_width():
    kernels = parse_sass(SASS)
    assert set(kernels) == {("sm_90", "_Z3vecv"), ("sm_90", "_Z6scalarv")}
    vec, scalar = analyse(kernels[("sm_90", "_Z3vecv")]), analyse(kernels[("sm_90", "_Z6scalarv")])
    # 0x0010's 128-bit load lies before the loop; the self-branch at 0xc0 is a loop with no 128-bit access
    assert (vec.loads_128, vec.stores_128, vec.scalar_loads, vec.scalar_stores) == (2, 1, 3, 0)
    assert (vec.hot_loops, vec.hot_loop_scalar, vec.hot_loop_64, vec.local_ops) == (1, [1], [1], 0)
    assert vec.hot_loop_load_bytes == [16 + 8 + 2]
    assert (scalar.loads_128, scalar.hot_loops, scalar.local_ops, scalar.scalar_stores) == (0, 0, 2, 1)


def test_ptxas_log_gives_registers_spills_stack_and_shared_memory():
    res = parse_ptxas_log(PTXAS)
    assert res[("sm_90", "_Z3vecv")] == Resources(40, 0, 0, 0, 128)
    assert res[("sm_90", "_Z6scalarv")] == Resources(40, 8, 144, 144, 0)


@pytest.mark.parametrize(
    ("arch", "regs", "smem", "threads", "blocks", "percent", "limiter"),
    [
        ("sm_90", 32, 0, 512, 4, 100.0, "threads"),
        ("sm_90", 40, 128, 512, 3, 75.0, "registers"),  # 40 x 32 = 1280 per warp: 51 warps
        ("sm_90", 41, 0, 512, 2, 50.0, "registers"),  # 1312 rounds up to 1536: 42 warps
        ("sm_80", 98, 0, 512, 1, 25.0, "registers"),
        ("sm_90", 32, 0, 128, 16, 100.0, "threads"),
        ("sm_80", 16, 0, 32, 32, 50.0, "blocks"),
        ("sm_80", 32, 60 * 1024, 256, 2, 25.0, "shared memory"),  # 164 KB / (60 KB + 1 KB reserved)
        ("sm_90", 32, 60 * 1024, 256, 3, 37.5, "shared memory"),  # 228 KB / 61 KB
    ],
)
def test_occupancy_follows_the_architecture_limits(arch, regs, smem, threads, blocks, percent, limiter):
    occ = occupancy(ARCHS[arch], regs, smem, threads)
    assert (occ.blocks, occ.percent, occ.limiter) == (blocks, percent, limiter)


def test_register_budget_for_a_number_of_blocks():
    assert [max_registers_for(ARCHS["sm_90"], b, 512) for b in (4, 3, 2, 1)] == [32, 40, 64, 128]


def test_rules_name_each_breach():
    ok = analyse(parse_sass(SASS)[("sm_90", "_Z3vecv")])
    no_vector = analyse(parse_sass(SASS)[("sm_90", "_Z6scalarv")])
    full, quarter = occupancy(ARCHS["sm_90"], 32, 0, 512), occupancy(ARCHS["sm_90"], 98, 0, 512)
    assert problems_of("accumulate_kernel<true, false>", Resources(32, 0, 0, 0, 0), ok, full, 512) == []
    found = problems_of("optim_kernel<AdamW, 1>", Resources(98, 8, 144, 144, 0), no_vector, quarter, 512)
    assert found == ["spills 144/144 B", "8 B stack frame", "2 local-memory instructions",
                     "vectorised kernel without 128-bit loads",
                     "occupancy 25% < 50% (registers), 0 KB of loads in flight per SM"]  # fmt: skip
    # the generic norm reads one element at a time by design: no 128-bit rule for it
    assert problems_of("norm_kernel<float, false>", Resources(30, 0, 0, 0, 0), no_vector, full, 512) == [
        "2 local-memory instructions"
    ]


@pytest.mark.parametrize(("bytes_per_iteration", "passes"), [(64, True), (48, False)])
def test_one_block_per_sm_passes_only_with_enough_loads_in_flight(bytes_per_iteration, passes):
    """25% occupancy: 512 resident threads x 64 B = 32 KB in flight passes, x 48 B = 24 KB does not."""
    sass = analyse(parse_sass(SASS)[("sm_90", "_Z3vecv")])
    sass.hot_loop_load_bytes = [bytes_per_iteration, 128]  # the poorest hot loop decides
    found = problems_of(
        "optim_kernel<AdamW, 0>", Resources(90, 0, 0, 0, 0), sass, occupancy(ARCHS["sm_90"], 90, 0, 512), 512
    )
    assert found == ([] if passes else ["occupancy 25% < 50% (registers), 24 KB of loads in flight per SM"])


def test_names_are_short_and_readable():
    demangled = subprocess.run(
        ["c++filt"],
        input="_ZN7gradacc4cuda12scale_kernelILNS_9ScaleModeE1EEEvNS0_8ListMetaILi1EEENS0_9ScaleArgsE\n"
        "_ZN7gradacc4cuda20norm_finalize_kernelIdEEvPKNS_8NormAccTIT_EEPKilNS_8NormKindEdPS3_SA_\n"
        "_ZN7gradacc4cuda12optim_kernelINS_4LionELi0ELNS_12StateStorageE2EEEvNS0_8ListMetaIXcl11optim_depthT1_EEEENS0_9OptimArgsE\n",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    want = ["scale_kernel<clip_norm>", "norm_finalize_kernel<double>", "optim_kernel<Lion, 0, int8>"]
    assert [short_name(d) for d in demangled] == want


def test_every_launch_uses_the_block_size_the_report_assumes():
    assert launch_block_threads() == 512


@pytest.mark.parametrize(
    ("device", "key"),
    [("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", "H200"), ("NVIDIA H100 PCIe", None), ("NVIDIA A100", None)],
)
def test_only_the_modelled_gpus_get_a_prediction(device, key):
    gpu = gpu_of(device)
    assert (gpu.key if gpu else None) == key


def test_gpu_verify_summary_puts_the_measured_figure_beside_the_prediction(tmp_path):
    """A fused-step record and a compare.py cell of an H100 run, against the committed predictions."""
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "results" / "compare_eager").mkdir(parents=True)
    gpu = {"name": "NVIDIA H100 80GB HBM3", "capability": "9.0", "free_gib": 79, "total_gib": 80}
    (work / "preflight.json").write_text(json.dumps({"gpus": [gpu]}))
    (work / "steps.tsv").write_text("bench_step\tok\t0\t12.0\t40\t\n")
    floor = 38 * 124_439_808
    fused = {"title": "gpt2-small: 148 tensors", "roofline_gbps": 3000.0, "floor_bytes": floor, "targets": [],
             "rows": [{"contender": "gradacc fused step", "ms": 2.0, "pct_copy": 80.0, "peak_bytes": 0}]}  # fmt: skip
    (work / "results" / "fused_step_cuda_gpt2-small.json").write_text(json.dumps(fused))
    cells = [{"workload": "gpt2-small", "op": "norm", "impl": "gradacc", "bytes": 497_759_232, "median_s": 2e-4}]
    compare = {"copy": {"gbps": 2500.0}, "cells": cells}
    (work / "results" / "compare_eager" / "cuda.json").write_text(json.dumps(compare))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_verify_report.py"), str(work), str(out)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["key"]: r for r in summary["model_check"]["rows"]}
    assert set(rows) == {"fused_step", "norm"} and summary["model_check"]["source"].endswith("_kernel_report.json")
    eff = rows["fused_step"]["efficiency"]
    assert rows["fused_step"]["predicted_ms"] == pytest.approx(floor / (3350e9 * 0.90 * eff) * 1e3)
    assert rows["fused_step"]["model_ms_at_run_copy"] == pytest.approx(floor / (3000e9 * eff) * 1e3)
    assert rows["norm"]["measured_over_predicted"] == pytest.approx(0.2 / rows["norm"]["predicted_ms"])
    md = (out / "summary.md").read_text()
    assert "Model check (predictions: benchmarks/results/" in md and "| fused_step | gpt2-small | 4,728.7 |" in md
    assert sorted(p.name for p in out.iterdir()) == ["gpu_verify_logs.tar.gz", "summary.json", "summary.md"]
