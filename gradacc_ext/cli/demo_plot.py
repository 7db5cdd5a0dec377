"""The demo's loss-curve PNG, drawn with matplotlib's Agg backend (the `plot` extra)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path


def matplotlib_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def write_loss_png(path: Path, losses: Sequence[float], title: str) -> None:
    """Writes the per-optimizer-step loss curve to `path`.

    Raises RuntimeError when matplotlib is missing: the caller decides how to say so.
    """
    if not matplotlib_available():
        raise RuntimeError("matplotlib is not installed (pip install 'gradacc_ext[plot]')")
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede the pyplot import
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        steps = range(1, len(losses) + 1)
        ax.plot(steps, losses, linewidth=0.8, alpha=0.45, label="loss (token mean over the optimizer step)")
        window = max(1, len(losses) // 50)
        if window > 1:
            ax.plot(steps, moving_average(losses, window), linewidth=1.8, label=f"moving average ({window} steps)")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross-entropy (nats / token)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
