"""Fake (meta) kernels for torch.compile, one per core op of csrc/ops.cpp, from its record (core_args.py).

torch.library also runs these as the ops' Meta kernels, which the dispatcher
picks whenever any argument is a meta tensor. So they run the same argument
checks as the compiled binding (the record's check() mirrors csrc/binding.cpp):
a meta tensor mixed into a CPU list is rejected by name, never silently skipped,
and torch.compile reports bad input at trace time. In-place ops return nothing;
global_norm describes its two outputs (float32, or float64 for a list that holds a float64 tensor).
"""

from __future__ import annotations

import torch

from .core_args import CORE_RECORDS, CoreOp


def register() -> None:
    for record in CORE_RECORDS:
        torch.library.register_fake(f"gradacc::{record.NAME}")(_fake_of(record))


def _fake_of(record: type[CoreOp]):
    def fake(*args) -> object:  # the op's schema order: the record's fields
        a = record.from_args(*args)
        a.check()
        return a.fake_result()

    return fake
