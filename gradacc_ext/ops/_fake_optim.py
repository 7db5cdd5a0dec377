"""Fake (meta) kernels of the fused optimizer steps: the same checks as csrc/binding_optim.cpp."""

from __future__ import annotations

import torch

from ._checks_optim import check_step
from .optim_args import RECORDS, OptimStep


def register() -> None:
    for record in RECORDS:
        torch.library.register_fake(f"gradacc::{record.NAME}")(_fake_of(record))


def _fake_of(record: type[OptimStep]):
    def fake(*args) -> None:  # the op's schema order: the record's fields
        check_step(record.from_args(*args))

    return fake
