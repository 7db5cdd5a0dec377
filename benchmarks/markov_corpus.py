"""The learnable corpus of benchmarks/convergence.py: an order-2 Markov chain over a small vocabulary.

Generated, never downloaded: the chain is drawn once from its own seed (every run, every training seed and
every optimizer sees the same language), and each context (the two previous tokens) allows a few next tokens
with Dirichlet(1) probabilities. A model has to learn vocab² contexts, so the loss falls over hundreds of
steps, not tens, and it has a known floor: the chain's own cross-entropy on the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class MarkovCorpus:
    vocab: int = 32
    successors: int = 4  # next tokens each context allows
    seed: int = 1234  # the chain itself; training seeds only change which sequences are drawn

    def __post_init__(self) -> None:
        if self.vocab < 2:
            raise ValueError(f"MarkovCorpus: vocab must be >= 2, got {self.vocab}")
        if not 1 <= self.successors <= self.vocab:
            raise ValueError(f"MarkovCorpus: successors must be in [1, vocab={self.vocab}], got {self.successors}")

    @cached_property
    def probs(self) -> torch.Tensor:
        """[vocab, vocab, vocab]: the probability of each next token after each (previous-but-one, previous)."""
        g = torch.Generator().manual_seed(self.seed)
        v = self.vocab
        nxt = torch.stack([torch.randperm(v, generator=g)[: self.successors] for _ in range(v * v)])
        weights = -torch.rand(v * v, self.successors, generator=g, dtype=torch.float64).log()  # Dirichlet(1)
        probs = torch.zeros(v * v, v, dtype=torch.float64).scatter_(1, nxt, weights)
        return (probs / probs.sum(1, keepdim=True)).view(v, v, v)

    def sample(self, n: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """[n, length] token ids: two uniform tokens, then the chain."""
        if n < 1 or length < 3:
            raise ValueError(f"MarkovCorpus.sample: need n >= 1 and length >= 3, got n={n}, length={length}")
        tokens = torch.empty(n, length, dtype=torch.long)
        tokens[:, :2] = torch.randint(0, self.vocab, (n, 2), generator=generator)
        for t in range(2, length):
            after = self.probs[tokens[:, t - 2], tokens[:, t - 1]]  # [n, vocab]: each row's next-token law
            tokens[:, t] = torch.multinomial(after, 1, generator=generator)[:, 0]
        return tokens

    def floor(self, tokens: torch.Tensor) -> float:
        """The chain's own mean cross-entropy (nats) on tokens[:, 2:]: the loss a perfect model reaches there."""
        p = self.probs[tokens[:, :-2], tokens[:, 1:-1], tokens[:, 2:]]
        return float(-p.log().mean())
