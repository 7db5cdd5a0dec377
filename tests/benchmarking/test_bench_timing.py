"""The benchmark's timing (torch.utils.benchmark.Timer), its roofline and its quiet profiler."""

from __future__ import annotations

import pytest
import torch

from gradacc_ext.benchmarking import timing

FAST = timing.TimingConfig(threshold=0.5, min_time_s=0.0, max_time_s=0.01)


def test_rotating_visits_every_input_in_turn():
    seen: list[int] = []
    fn = timing.rotating(seen.append, [0, 1, 2])
    for _ in range(7):
        fn()
    assert seen == [0, 1, 2, 0, 1, 2, 0]


def test_measure_calibrates_blocks_and_summarizes():
    x = torch.randn(4096)
    m = timing.measure(lambda: x.mul_(1.0001), FAST)
    stats = timing.summarize(m)
    assert stats["calls_per_block"] >= 1 and stats["blocks"] >= 1
    assert 0 < stats["best_s"] <= stats["median_s"]
    assert stats["spread"] == pytest.approx(m.iqr / m.median)


def test_interleaved_turns_alternate_and_merge_every_block():
    order: list[str] = []
    calls = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    cfg = timing.TimingConfig(threshold=0.5, min_time_s=0.0, max_time_s=0.03, rounds=3)
    turns = timing.measure_interleaved(calls, cfg)
    assert {name: len(ms) for name, ms in turns.items()} == {"a": 3, "b": 3}
    # Runs of one name in call order: a b, then b a, then a b (the order reverses every round).
    runs = [name for i, name in enumerate(order) if i == 0 or order[i - 1] != name]
    assert runs == ["a", "b", "a", "b"]  # a b | b a | a b: the middle b b and a a join
    stats = timing.summarize(turns["a"])
    per_call = sorted(t / m.number_per_run for m in turns["a"] for t in m.raw_times)
    assert stats["blocks"] == len(per_call) and stats["best_s"] == per_call[0]
    assert stats["calls_per_block"] == min(m.number_per_run for m in turns["a"])


def test_summarize_of_several_turns_is_that_of_their_blocks_pooled():
    np = pytest.importorskip("numpy")
    x = torch.randn(4096)
    turns = [timing.measure(lambda: x.mul_(1.0001), FAST) for _ in range(3)]
    pooled = np.array([t / m.number_per_run for m in turns for t in m.raw_times])
    q1, median, q3 = np.percentile(pooled, [25, 50, 75])
    stats = timing.summarize(turns)
    assert stats["median_s"] == pytest.approx(median, rel=1e-12)
    assert stats["spread"] == pytest.approx((q3 - q1) / median, rel=1e-9, abs=1e-12)
    assert stats["blocks"] == len(pooled) and stats["best_s"] == pooled.min()


def test_measure_sets_the_thread_count_only_while_timing():
    before = torch.get_num_threads()
    inside: list[int] = []
    timing.measure(lambda: inside.append(torch.get_num_threads()), timing.TimingConfig(0.5, 0.0, 0.01, threads=1))
    assert set(inside) == {1} and torch.get_num_threads() == before


@pytest.mark.parametrize(
    "bad",
    [{"threshold": 0.0}, {"min_time_s": 2.0, "max_time_s": 1.0}, {"min_time_s": -1.0}, {"threads": 0}, {"rounds": 0}],
)
def test_timing_config_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="invalid timing config"):
        timing.TimingConfig(**bad)


def test_roofline_is_the_fastest_stream_over_every_sample():
    roofline = timing.Roofline(torch.device("cpu"), 1 << 20, threads=1)
    src, dst = roofline.streams()
    assert 4 * (src.numel() + dst.numel()) == (1 << 20) // 2  # half the bytes the sets move
    assert bool((src == 1.0).all()) and bool((dst == 0.5).all())  # written, not lazily zero-mapped pages
    samples = [roofline.sample(), roofline.sample()]
    assert roofline.gbps == max(max(s.values()) for s in samples)
    assert all(set(s) == {"copy_gbps", "inplace_gbps"} and min(s.values()) > 0 for s in samples)
    # Between samples the roofline holds no stream: nothing of it sits beside a cell's input sets.
    assert not any(isinstance(v, torch.Tensor) for v in vars(roofline).values())


def test_roofline_percent_is_none_above_the_fastest_sample():
    roofline = timing.Roofline(torch.device("cpu"), 1 << 10, threads=1)
    roofline.samples = [{"copy_gbps": 8.0, "inplace_gbps": 12.0}, {"copy_gbps": 16.0, "inplace_gbps": 10.0}]
    assert roofline.percent(4.0) == 25.0 and roofline.percent(16.0) == 100.0  # of the fastest: 16 GB/s
    assert roofline.percent(16.5) is None  # timed in a quieter moment than every sample: no %


def test_counting_ops_prints_nothing_on_stderr(capfd):
    xs = [torch.randn(5) for _ in range(3)]
    count, unit = timing.count_launches(lambda: torch._foreach_add_(xs, 1.0), torch.device("cpu"))
    _, err = capfd.readouterr()
    assert count >= 1 and unit == "dispatched ops"
    assert err == ""  # the profiler's USDT start/stop lines go to fd 2; they must be dropped


def test_a_cell_above_the_roofline_shows_no_percentage():
    from gradacc_ext.benchmarking import report

    cell = {"workload": "w", "op": "norm", "impl": "gradacc", "median_s": 1e-3, "spread": 0.5, "gbps": 9.0,
            "pct_copy": None, "host_sync": "n/a", "first_call_s": 0.0}  # fmt: skip
    row = report.results_table({"meta": {"device": "cpu"}, "cells": [cell]})[-1]
    assert report.OVER_ROOFLINE in row and "%" not in row.replace("50.0%", "")
