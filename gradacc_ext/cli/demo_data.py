"""The demo's embedded task: procedurally generated sequences, no downloads.

Each sequence follows a deterministic rule, a modular walk: a start token s
and a stride d, then x[t+1] = (x[t] + d) mod M, so after two tokens the rest
is predictable. A fraction of the tokens is replaced by random ones (noise
the model cannot learn, which keeps the loss above zero), and lengths vary
between min_len and max_len, right-padded with PAD. Because lengths vary, the
micro-batches of one optimizer step hold different numbers of real tokens:
averaging their mean losses would weight tokens unequally, which is exactly
what the demo's full-batch equivalence check catches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD = 0  # token id 0 is padding; real tokens are 1..vocab_size-1


@dataclass(frozen=True)
class TaskConfig:
    vocab_size: int = 32
    min_len: int = 8
    max_len: int = 48
    max_stride: int = 3  # strides are drawn from 1..max_stride
    noise: float = 0.05  # probability that a token is replaced by a random one

    def __post_init__(self) -> None:
        if self.vocab_size < 3:
            raise ValueError(f"vocab_size must be >= 3, got {self.vocab_size}")
        if not 2 <= self.min_len <= self.max_len:
            raise ValueError(f"need 2 <= min_len <= max_len, got min_len={self.min_len}, max_len={self.max_len}")
        if not 1 <= self.max_stride < self.vocab_size - 1:
            raise ValueError(f"max_stride must be in [1, vocab_size - 2], got {self.max_stride}")
        if not 0.0 <= self.noise < 1.0:
            raise ValueError(f"noise must be in [0, 1), got {self.noise}")


@dataclass(frozen=True)
class Batch:
    """Token ids [B, max_len] (PAD after each sequence's length) and lengths [B]."""

    tokens: torch.Tensor
    lengths: torch.Tensor

    @property
    def inputs(self) -> torch.Tensor:
        return self.tokens[:, :-1]

    @property
    def targets(self) -> torch.Tensor:
        """Next-token targets; PAD where there is no real next token (ignored by the loss)."""
        return self.tokens[:, 1:]

    def num_tokens(self) -> int:
        """Real (non-PAD) targets: the weight of this batch in a token-mean loss."""
        return int((self.targets != PAD).sum())

    def split(self, micro_batch: int) -> list[Batch]:
        """Consecutive micro-batches of at most `micro_batch` sequences each."""
        return [
            Batch(self.tokens[i : i + micro_batch], self.lengths[i : i + micro_batch])
            for i in range(0, self.tokens.shape[0], micro_batch)
        ]

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.tokens.to(device), self.lengths.to(device))


def make_batch(config: TaskConfig, batch_size: int, generator: torch.Generator) -> Batch:
    """`batch_size` fresh sequences drawn from `generator` (CPU), deterministic for a given seed."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    modulus = config.vocab_size - 1
    start = torch.randint(0, modulus, (batch_size, 1), generator=generator)
    stride = torch.randint(1, config.max_stride + 1, (batch_size, 1), generator=generator)
    steps = torch.arange(config.max_len).unsqueeze(0)
    clean = (start + stride * steps) % modulus + 1  # ids 1..modulus
    noisy = torch.rand(clean.shape, generator=generator) < config.noise
    random_tokens = torch.randint(1, config.vocab_size, clean.shape, generator=generator)
    tokens = torch.where(noisy, random_tokens, clean)
    lengths = torch.randint(config.min_len, config.max_len + 1, (batch_size,), generator=generator)
    tokens = tokens.masked_fill(steps >= lengths.unsqueeze(1), PAD)
    return Batch(tokens, lengths)
