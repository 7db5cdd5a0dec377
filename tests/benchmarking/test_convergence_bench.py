"""Smoke and logic tests of benchmarks/convergence.py (issue 30's quality benchmark): the corpus is the chain it
claims to be, a tiny run writes its table, JSON and plot, a contender that cannot run is listed with its reason,
and the gaps are the issue's relative ones. The losses themselves are not judged here (the committed run is)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
pytestmark = pytest.mark.skipif(
    not (BENCHMARKS / "convergence.py").exists(),
    reason="needs the source tree's benchmarks/ (CI's wheel run tests a copy of tests/ alone)",
)


@pytest.fixture
def benchmarks(monkeypatch: pytest.MonkeyPatch, one_cpu_thread: None) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))


def test_corpus_follows_its_chain_and_its_floor_is_the_chains_loss(benchmarks: None) -> None:
    from markov_corpus import MarkovCorpus

    corpus = MarkovCorpus(vocab=8, successors=2, seed=5)
    probs = corpus.probs
    assert torch.allclose(probs.sum(-1), torch.ones(8, 8, dtype=torch.float64), rtol=0, atol=1e-12)
    assert ((probs > 0).sum(-1) == 2).all()
    assert torch.equal(probs, MarkovCorpus(vocab=8, successors=2, seed=5).probs)  # the same language
    tokens = corpus.sample(50, 20, torch.Generator().manual_seed(1))
    assert probs[tokens[:, :-2], tokens[:, 1:-1], tokens[:, 2:]].min() > 0  # every transition is the chain's
    expected = -sum(math.log(probs[s[t - 2], s[t - 1], s[t]]) for s in tokens.tolist() for t in range(2, 20)) / 900
    assert corpus.floor(tokens) == pytest.approx(expected, rel=1e-12)
    assert corpus.floor(tokens) < math.log(2) + 1e-9  # at most two successors per context
    with pytest.raises(ValueError, match="successors"):
        MarkovCorpus(vocab=8, successors=9)


def test_tiny_run_writes_table_json_and_plot(benchmarks: None, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the plot or bench extra)")
    import convergence

    names = ["FusedAdamW fp32 states", "FusedAdamW int8 states", "torch AdamW (foreach)"]
    argv = ["--steps", "3", "--seeds", "0", "1", "--eval-every", "2", "--vocab", "8", "--seq-len", "6"]
    argv += ["--d-model", "8", "--heads", "2", "--layers", "1", "--accumulation", "2", "--micro-batch", "2"]
    convergence.main([*argv, "--eval-sequences", "4", "--contenders", *names, "--out-dir", str(tmp_path)])
    (md,) = tmp_path.glob("*_convergence_cpu_*.md")
    assert md.with_suffix(".png").stat().st_size > 0
    record = json.loads(md.with_suffix(".json").read_text())
    rows = {r["contender"]: r for r in record["rows"]}
    fused, torch_adamw = rows[names[0]]["runs"], rows[names[2]]["runs"]
    assert [r["seed"] for r in fused] == [0, 1] and [s for s, _ in fused[0]["curve"]] == [0, 2, 3]
    # the same seed starts from the same weights: the same loss before the first step
    assert fused[0]["curve"][0] == torch_adamw[0]["curve"][0] != fused[1]["curve"][0]
    if "skipped" in rows[names[1]]:  # until FusedAdamW takes state_dtype
        assert rows[names[1]]["skipped"].startswith("not available in this build")
    text = md.read_text()
    assert "| +0.00% | +0.00% – +0.00% | – |" in text  # fp32 states: its own reference; no torchao row ran


def test_gaps_are_relative_to_the_references(benchmarks: None) -> None:
    from convergence_report import gap, table

    def row(name: str, *finals: float) -> dict:
        runs = [{"seed": s, "curve": [(0, 9.0), (5, f)], "train": [1.0], "seconds": 1.0} for s, f in enumerate(finals)]
        return {"contender": name, "runs": runs}

    rows = [row("FusedAdamW fp32 states", 2.0, 2.2), row("torchao AdamW8bit eager", 2.0), row("other", 2.31, 2.31)]
    lines = table([*rows, {"contender": "absent", "skipped": "not installed"}])
    assert lines[2].startswith(
        "| FusedAdamW fp32 states | 2.1000 | 2.0000 – 2.2000 | +0.00% | +0.00% – +0.00% | +5.00% |"
    )
    # mean gap (2.31 - 2.1) / 2.1; per seed (2.31 - 2.0) / 2.0 and (2.31 - 2.2) / 2.2, paired by seed
    assert lines[4].startswith("| other | 2.3100 | 2.3100 – 2.3100 | +10.00% | +5.00% – +15.50% | +15.50% |")
    assert lines[3].startswith("| torchao AdamW8bit eager | 2.0000 | 2.0000 – 2.0000 | -4.76% | +0.00% – +0.00% |")
    assert lines[5] == "| absent | not installed ||||||"
    assert gap(1.0, None) == "–"
