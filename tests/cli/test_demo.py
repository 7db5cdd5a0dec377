"""`gradacc demo` end to end at tiny sizes, its equivalence check, and its parts (data, progress, plot)."""

from __future__ import annotations

import io
import re

import pytest
import torch

from gradacc_ext.accumulate.window_end import WindowEnd
from gradacc_ext.cli import demo_plot, main
from gradacc_ext.cli.demo import BF16_CPU_HINT
from gradacc_ext.cli.demo_data import PAD, TaskConfig, make_batch
from gradacc_ext.cli.demo_train import progress_bar

TINY = ("--d-model", "16", "--n-layers", "1", "--max-len", "16", "--timing-steps", "1", "--check-steps", "2")


def run_demo(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    code = main(["demo", "--device", "cpu", *TINY, *argv])
    out, _ = capsys.readouterr()
    return code, out


def reported(out: str, pattern: str) -> str:
    match = re.search(pattern, out)
    assert match, f"{pattern!r} not in output:\n{out}"
    return match.group(1)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_demo_trains_reports_and_matches_full_batch(capsys, tmp_path, backend):
    png = tmp_path / "loss.png"
    code, out = run_demo(
        capsys, "--batch-size", "3", "--grad-accum-steps", "3", "--steps", "4", "--backend", backend, "--out", str(png)
    )
    assert code == 0, out
    assert "micro-batch 3 x steps 3 x world 1 = effective batch 9" in out
    assert "100%" in out  # the progress bar finished
    assert reported(out, r"optimizer steps: (\d+)") == "4"
    assert reported(out, r"skipped \(inf/NaN\): (\d+)") == "0"
    low, mean, high = (float(x) for x in re.search(r"min ([\d.]+)\s+mean ([\d.]+)\s+max ([\d.]+)", out).groups())
    assert 0 < low <= mean <= high
    assert float(reported(out, r"backend=torch \(pure PyTorch\) ([\d.]+) ms")) > 0
    assert float(reported(out, r"backend=auto -> \w+ ([\d.]+) ms")) > 0
    assert "MATCH" in out and "MISMATCH" not in out
    diff, tol = float(reported(out, r"max \|param diff\| (\S+)")), float(reported(out, r"tolerance (\S+)\)"))
    assert diff <= tol
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_demo_detects_wrong_normalisation(capsys):
    # Averaging each micro-batch's own token mean weights tokens unequally when
    # lengths vary: the accumulated run drifts from the full batch and the
    # check must say so and fail the command.
    code, out = run_demo(
        capsys,
        "--batch-size",
        "2",
        "--grad-accum-steps",
        "4",
        "--steps",
        "2",
        "--no-plot",
        "--loss-norm",
        "mean-of-means",
    )
    assert code == 1, out
    assert "MISMATCH" in out
    diff, tol = float(reported(out, r"max \|param diff\| (\S+)")), float(reported(out, r"tolerance (\S+)\)"))
    assert diff > tol


def test_demo_detects_a_wrong_normaliser_inside_the_accumulator(capsys, monkeypatch):
    # A library bug rather than a user one: the window's normaliser counts one
    # token too many. Clipping is off so nothing rescales the gradient back.
    real = WindowEnd._inv_scale
    monkeypatch.setattr(WindowEnd, "_inv_scale", lambda self, count: real(self, count + 1))
    code, out = run_demo(
        capsys, "--batch-size", "2", "--grad-accum-steps", "3", "--steps", "1", "--no-plot", "--max-grad-norm", "0"
    )
    assert code == 1, out
    assert "MISMATCH" in out


def test_demo_without_matplotlib_says_the_plot_was_skipped(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(demo_plot, "matplotlib_available", lambda: False)
    png = tmp_path / "loss.png"
    code, out = run_demo(capsys, "--batch-size", "2", "--grad-accum-steps", "2", "--steps", "1", "--out", str(png))
    assert code == 0, out
    assert "loss curve: skipped, matplotlib is not installed" in out
    assert not png.exists()


def test_demo_fp16_on_cpu_counts_skipped_steps(capsys):
    # The first fp16 windows overflow at the initial loss scale 2**16: they must be
    # skipped (not applied) and counted, and the loss scaler backs off.
    code, out = run_demo(
        capsys, "--batch-size", "2", "--grad-accum-steps", "2", "--steps", "3", "--amp", "fp16", "--no-plot"
    )
    assert code == 0, out
    steps, skipped = int(reported(out, r"optimizer steps: (\d+)")), int(reported(out, r"skipped \(inf/NaN\): (\d+)"))
    assert steps + skipped == 3 and skipped >= 1


# -- parts ----------------------------------------------------------------------------------------------------------


def test_task_batches_follow_the_rule_with_padding(gen):
    config = TaskConfig(vocab_size=17, min_len=5, max_len=20, noise=0.0)
    batch = make_batch(config, 64, gen)
    assert batch.tokens.shape == (64, 20)
    assert int(batch.lengths.min()) >= 5 and int(batch.lengths.max()) <= 20
    assert len(set(batch.lengths.tolist())) > 1  # variable lengths, so token weighting matters
    modulus = config.vocab_size - 1
    for row, length in zip(batch.tokens, batch.lengths.tolist(), strict=True):
        real = row[:length] - 1
        assert bool((row[length:] == PAD).all()) and bool((real >= 0).all())
        stride = (real[1] - real[0]) % modulus
        assert bool(((real[1:] - real[:-1]) % modulus == stride).all())
    assert batch.num_tokens() == int((batch.lengths - 1).sum())
    assert sum(m.num_tokens() for m in batch.split(5)) == batch.num_tokens()


def test_task_is_reproducible_and_noisy():
    config = TaskConfig(noise=0.5)
    a = make_batch(config, 8, torch.Generator().manual_seed(3))
    b = make_batch(config, 8, torch.Generator().manual_seed(3))
    assert torch.equal(a.tokens, b.tokens)
    clean = make_batch(TaskConfig(noise=0.0), 8, torch.Generator().manual_seed(3))
    assert not torch.equal(a.tokens, clean.tokens)


@pytest.mark.parametrize(
    ("bad", "message"), [({"vocab_size": 2}, "vocab_size"), ({"min_len": 1}, "min_len"), ({"noise": 1.0}, "noise")]
)
def test_task_config_rejects_bad_values(bad, message):
    with pytest.raises(ValueError, match=message):
        TaskConfig(**bad)


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("stream", "interval", "ascii_only"), [(io.StringIO(), 5.0, True), (FakeTTY(), 0.2, False)])
def test_progress_bar_is_tqdm_redrawn_often_only_on_a_terminal(stream, interval, ascii_only):
    with progress_bar(7, stream) as bar:
        for _ in range(7):
            bar.update(1)
    assert bar.mininterval == interval and bool(bar.ascii) is ascii_only
    assert "7/7" in stream.getvalue() and "100%" in stream.getvalue()


def test_demo_bf16_on_cpu_says_once_that_it_is_slow(capsys):
    code, out = run_demo(capsys, "--batch-size", "2", "--grad-accum-steps", "2", "--steps", "2", "--amp", "bf16",
                         "--no-plot")  # fmt: skip
    assert code == 0, out
    assert out.count(BF16_CPU_HINT) == 1
    code, out = run_demo(capsys, "--batch-size", "2", "--grad-accum-steps", "2", "--steps", "1", "--no-plot")
    assert code == 0 and BF16_CPU_HINT not in out


def test_moving_average_is_a_trailing_mean():
    assert demo_plot.moving_average([1.0, 2.0, 3.0, 4.0, 10.0], 2) == [1.0, 1.5, 2.5, 3.5, 7.0]
    assert demo_plot.moving_average([5.0, 1.0], 1) == [5.0, 1.0]
