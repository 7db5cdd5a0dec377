"""benchmarks/state_memory.py counts the bytes a parameter holds, optimizer state included (issue 30).

The bytes held are deterministic (live tensors, each storage once), so they are asserted exactly against the
arithmetic of the model's own tensors: bf16 param 2 B, fp32 buffer 4 B, fp32 m and v 8 B, one fp32 step per
tensor, and (master mode) a 4 B fp32 master copy.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
pytestmark = pytest.mark.skipif(
    not (BENCHMARKS / "state_memory.py").exists(),
    reason="needs the source tree's benchmarks/ (CI's wheel run tests a copy of tests/ alone)",
)
# Tensor sizes are multiples of 4 elements: the buffers' 16-byte alignment adds no padding.
SMALL = argparse.Namespace(device="cpu", vocab=96, ctx=12, width=16, layers=1, heads=2, micro_batch=2)


@pytest.fixture
def state_memory(monkeypatch: pytest.MonkeyPatch, one_cpu_thread: None):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import state_memory

    return state_memory


def _model_facts() -> tuple[int, int]:
    from memory import GPT

    params = list(GPT(SMALL.vocab, SMALL.ctx, SMALL.width, SMALL.layers, SMALL.heads).parameters())
    return sum(p.numel() for p in params), len(params)


@pytest.mark.parametrize(
    ("name", "master", "moments"),
    [
        ("FusedAdamW fp32 states", 0, 8),  # stochastic rounding: no master; m, v in fp32
        ("FusedAdamW master, fp32 states", 4, 8),
        ("torch AdamW (foreach)", 0, 4),  # torch keeps a bf16 param's m, v in bf16
    ],
)
def test_held_bytes_are_the_tensors_arithmetic(state_memory, name: str, master: int, moments: int) -> None:
    row = state_memory.measure(state_memory.CONTENDERS[name], SMALL)
    n, tensors = _model_facts()
    assert row["params"] == n
    assert row["param"] == 2 * n
    assert row["grad buffer"] == 4 * n  # fp32 accumulation buffers; no .grad outside them between windows
    assert row["master"] == master * n
    assert row["optimizer state"] == moments * n + 4 * tensors  # + one fp32 step scalar per tensor
    assert row["window_peak"] > 0  # the allocator probe saw the window's activations and temporaries


def test_fp32_states_hold_14_bytes_per_param(state_memory) -> None:
    (row,) = state_memory.run(["FusedAdamW fp32 states"], SMALL)
    held = sum(row[c] for c in state_memory.COLUMNS)
    assert round(held / row["params"], 1) == 14.0
    # the steps' 4 bytes per tensor add about a hundredth of a byte per param at this size (16 tensors)
    line = state_memory.table([row])[-1]
    assert line.startswith("| FusedAdamW fp32 states | 2.00 | 4.00 | – | 8.0") and "| ≤ 14: " in line


def test_targets_are_judged_on_the_rounded_bytes(state_memory) -> None:
    assert state_memory.verdict("FusedAdamW fp32 states", 14.004) == "≤ 14: met"  # the steps' few thousandths
    assert state_memory.verdict("FusedAdamW fp32 states", 14.006) == "≤ 14: NOT met"
    assert state_memory.verdict("FusedAdamW int8 states", 8.1) == "≤ 8.1: met"
    assert state_memory.verdict("FusedAdamW bf16 states", 10.12) == "≤ 10.1: NOT met"
    assert state_memory.verdict("torch AdamW (foreach)", 10.0) == "–"


def test_a_storage_is_counted_once(state_memory) -> None:
    flat = torch.randn(64)
    views = [flat[:16], flat[16:], flat]
    seen: set[int] = set()
    assert state_memory._storages_bytes(views, seen) == 64 * 4
    assert state_memory._storages_bytes([flat[3:5], torch.randn(3, dtype=torch.float64)], seen) == 3 * 8


def test_unavailable_contenders_are_listed_not_run(state_memory, monkeypatch: pytest.MonkeyPatch) -> None:
    from optimizer_contenders import Contender

    def refuse(*_: object) -> None:
        raise AssertionError("a contender that is not available must not be built")

    absent = Contender("absent", refuse, lambda: "not available in this build: test")
    monkeypatch.setitem(state_memory.CONTENDERS, "absent", absent)
    rows = state_memory.run(["absent"], SMALL)
    assert rows == [{"contender": "absent", "skipped": "not available in this build: test"}]
    assert state_memory.table(rows)[-1].startswith("| absent | not available in this build: test |")


def test_torchao_quantized_state_counts_codes_scales_and_map(state_memory) -> None:
    pytest.importorskip("torchao", reason="torchao is optional (the bench extra)")
    from optimizer_contenders import tensors_of

    param = torch.nn.Parameter(torch.randn(8192))
    param.grad = torch.randn_like(param)
    optimizer = state_memory.CONTENDERS["torchao AdamW8bit eager"].build([param], 1e-3)
    with torch.compiler.set_stance("force_eager"):
        optimizer.step()
    state = optimizer.state[param]
    held = state_memory._storages_bytes(tensors_of(state["exp_avg"]), set())
    # one uint8 code per element, one fp32 scale per 256-element block, and the 256-entry fp32 map
    assert held == 8192 + 4 * 8192 // 256 + 4 * 256
