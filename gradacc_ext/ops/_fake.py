"""Fake (meta) kernels for torch.compile, one per op of csrc/ops.cpp, from its record: core_args.py for
the core ops, optim_args.py for the optimizer steps.

torch.library also runs these as the ops' Meta kernels, which the dispatcher
picks whenever any argument is a meta tensor. So they run the same argument
checks as the compiled binding (the records' checks mirror csrc/binding.cpp and
csrc/binding_optim.cpp): a meta tensor mixed into a CPU list is rejected by name,
never silently skipped, and torch.compile reports bad input at trace time.
In-place ops return nothing; global_norm describes its two outputs (float32, or
float64 for a list that holds a float64 tensor).
"""

from __future__ import annotations

import torch

from ._checks_optim import check_step
from .core_args import CORE_RECORDS, CoreOp
from .optim_args import RECORDS, OptimStep


def register() -> None:
    for record in (*CORE_RECORDS, *RECORDS):
        torch.library.register_fake(f"gradacc::{record.NAME}")(_fake_of(record))


def _fake_of(record: type[CoreOp] | type[OptimStep]):
    def fake(*args) -> object:  # the op's schema order: the record's fields
        a = record.from_args(*args)
        if isinstance(a, OptimStep):
            check_step(a)  # an optimizer step writes its lists in place and returns nothing
            return None
        a.check()
        return a.fake_result()

    return fake
