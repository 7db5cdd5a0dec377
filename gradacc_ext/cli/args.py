"""Argument types and checks shared by the subcommands.

Every numeric flag is parsed by a type that states its accepted range, so bad
input ends as an argparse error (exit code 2) such as
"argument --grad-accum-steps: must be an integer >= 1, got 0".
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

import torch

DEVICES = ("auto", "cpu", "cuda")


def int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer >= low (and <= high when given)."""
    bound = f">= {low}" if high is None else f"in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text}")
        return value

    parse.__name__ = f"integer {bound}"
    return parse


def float_above(low: float, *, inclusive: bool = False, note: str = "") -> Callable[[str], float]:
    bound = f"{'>=' if inclusive else '>'} {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        ok = (
            value is not None
            and value == value
            and value != float("inf")
            and (value >= low if inclusive else value > low)
        )
        if not ok:
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}{note}, got {text}")
        return value

    parse.__name__ = f"number {bound}"
    return parse


def resolve_device(parser: argparse.ArgumentParser, name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine (torch.cuda.is_available() is False)")
    return torch.device(name)


def check_output_file(parser: argparse.ArgumentParser, flag: str, path: Path) -> None:
    """Fails now, with a usage error, when `path` could not be written later (after minutes of work)."""
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        parser.error(f"{flag} {path}: is a folder; give a file path such as {path / 'loss.png'}")
    if not folder.is_dir():
        parser.error(f"{flag} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        parser.error(f"{flag} {path}: folder {folder} is not writable")
