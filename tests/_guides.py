"""Helpers of the guide tests: run a guide's snippet as written, and the hand-written loop it must equal.

A snippet is the guide's code with only its import lines changed (to gradacc_ext.compat) and a
small model substituted; it runs with exec() in a namespace that provides what the guide leaves
undefined (model, dataloader, criterion, optimizer, targets).
"""

from __future__ import annotations

import logging
import textwrap
from typing import Any

import torch
import torch.nn.functional as F

IN, CLASSES = 6, 4


def make_model(seed: int, gain: float = 1.0) -> torch.nn.Module:
    """gain scales the last layer's initial weights (a large gain gives gradient norms above 1)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, 8), torch.nn.Tanh(), torch.nn.Linear(8, CLASSES)).double()
    with torch.no_grad():
        model[2].weight.mul_(gain)
    return model


def make_batches(n: int, size: int, seed: int, scale: float = 1.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            scale * torch.randn(size, IN, generator=g, dtype=torch.float64),
            torch.randint(0, CLASSES, (size,), generator=g),
        )
        for _ in range(n)
    ]


class TargetsAlongside:
    """Seed 000's loop reads `batch` from the loader and `targets` from outside: this loader sets the
    namespace's `targets` to each batch's labels as it yields the inputs."""

    def __init__(self, batches: list, namespace: dict[str, Any]) -> None:
        self.batches, self.namespace = batches, namespace

    def __iter__(self):
        for x, y in self.batches:
            self.namespace["targets"] = y
            yield x


def run_snippet(code: str, **names: Any) -> dict[str, Any]:
    namespace = {"torch": torch, "nn": torch.nn, "logger": logging.getLogger("guide"), **names}
    for value in names.values():
        if isinstance(value, TargetsAlongside):
            value.namespace = namespace
    exec(compile(textwrap.dedent(code), "<guide snippet>", "exec"), namespace)
    return namespace


def hand_loop(model, optimizer, batches, steps: int, clip: float | None = None) -> list[float]:
    """The plain loop the guides describe: loss / steps, backward, clip and step every `steps` batches."""
    norms = []
    optimizer.zero_grad()
    for i, (x, y) in enumerate(batches):
        (F.cross_entropy(model(x), y) / steps).backward()
        if (i + 1) % steps == 0:
            params = list(model.parameters())
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip if clip else float("inf"))))
            optimizer.step()
            optimizer.zero_grad()
    return norms


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
