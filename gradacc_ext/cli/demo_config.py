"""What `gradacc demo` takes: DemoConfig and the bounds the command line checks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .demo_data import TaskConfig

LOSS_NORMS = ("tokens", "mean-of-means")
MIN_LEN = TaskConfig.min_len  # every sequence has at least this many tokens
# Attention costs grow with the square of the length and the demo trains on a CPU in about a minute:
# longer sequences than this only make it run for hours.
MAX_LEN = 1024


@dataclass(frozen=True)
class DemoConfig:
    """Everything `gradacc demo` takes; the CLI checks ranges before building one."""

    batch_size: int = 8  # micro-batch, in sequences
    grad_accum_steps: int = 4
    steps: int = 1000  # optimizer steps: about a minute on 2 CPU cores
    lr: float = 1e-2
    amp: str = "no"
    compile: bool = False
    max_grad_norm: float | None = 1.0
    seed: int = 0
    device: str = "cpu"
    out: Path | None = Path("gradacc_demo_loss.png")
    backend: str = "auto"
    # "mean-of-means" averages the micro-batches' own token means: the classic
    # bug with padded, variable-length batches; the equivalence check catches it.
    loss_norm: str = "tokens"
    d_model: int = 64
    n_layers: int = 2
    max_len: int = 48
    timing_steps: int = 10
    check_steps: int = 3
    # One intra-op thread by default: the demo's tensors are too small to gain from more,
    # and on a busy machine spinning worker threads make every step many times slower.
    threads: int = 1

    @property
    def effective_batch(self) -> int:
        return self.batch_size * self.grad_accum_steps
