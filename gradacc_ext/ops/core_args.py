"""The argument records of the core ops: each op described once in Python.

One dataclass per core op (accumulate_, accumulate_final_, global_norm, unscale_, clip_by_norm_,
clip_by_value_), as optim_args.py holds the optimizer steps'. Its fields are the op's arguments in
schema order, as csrc/core_ops.h (the C++ description the schemas are made from) names them;
tests/ops/test_core_args.py holds both equal to the compiled schemas. So ``record.args()`` is the
positional call of torch.ops.gradacc.<NAME> and ``Record.from_args(*args)`` reads one back. A field's
default is the public op's default (api.py's signatures take it from here). ``OUTPUTS`` names the
arguments the op writes (the schema's ``(a!)``); ``check()`` is every rule of csrc/binding.cpp for the
op, in its order, with its messages. From the records derive: the checks, the fake kernels (_fake.py),
the public ops' calls and their memory checks (api.py), and `gradacc info`'s op list (CORE_RECORDS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from ._checks import (
    Use,
    check_fast_norm_type,
    check_fits_float,
    check_list,
    check_max_norm,
    check_norm_scalar,
    check_norm_type,
    check_pair_dtype,
    check_same_shape,
    check_scalar,
    list_device,
    num,
)
from .constants import DEFAULT_EPS

Tensors = list[torch.Tensor]
LIST = "Tensors"  # a field's annotation (a string: postponed annotations) that marks a Tensor[] argument


def core_op(cls: type[CoreOp]) -> type[CoreOp]:
    """Makes `cls` a record (a keyword-only dataclass) and notes its fields' names by kind, once: the public ops
    read them on every call (and torch.compile traces them, which dataclasses.fields() is not)."""
    cls = dataclass(kw_only=True)(cls)
    cls.op = f"gradacc.{cls.NAME}"
    cls.ORDER = tuple(f.name for f in fields(cls))
    cls.LISTS = tuple(f.name for f in fields(cls) if f.type == LIST)
    cls.TENSORS = tuple(f.name for f in fields(cls) if "Tensor" in f.type)
    cls.OUTPUT_LISTS = tuple(name for name in cls.LISTS if name in cls.OUTPUTS)
    return cls


class CoreOp:
    """What every core op's record answers."""

    NAME: ClassVar[str]  # the op's name in torch.ops.gradacc
    op: ClassVar[str]  # the op as error messages name it, "gradacc.<NAME>" (set by core_op)
    OUTPUTS: ClassVar[tuple[str, ...]] = ()  # the arguments it writes, in schema order
    IN_PLACE_PAIRS: ClassVar[bool] = False  # the first input list's item i may be the first output list's item i
    ORDER: ClassVar[tuple[str, ...]]  # the argument names in schema order (set by core_op)
    LISTS: ClassVar[tuple[str, ...]]  # the Tensor[] arguments among them
    TENSORS: ClassVar[tuple[str, ...]]  # the tensor arguments: lists, single and optional tensors
    OUTPUT_LISTS: ClassVar[tuple[str, ...]]  # the Tensor[] arguments it writes

    @classmethod
    def from_args(cls, *args: object) -> CoreOp:
        """The record of a positional call of the op."""
        return cls(**dict(zip(cls.ORDER, args, strict=True)))

    def args(self) -> tuple:
        """The positional arguments of torch.ops.gradacc.<NAME> (and of reference.<NAME>)."""
        return tuple(self.__dict__.values())  # the dataclass __init__ sets the fields in their order

    def lists(self) -> dict[str, Tensors]:
        """The Tensor[] arguments, in schema order."""
        return {name: getattr(self, name) for name in self.LISTS}

    def empty(self) -> bool:
        """Whether every list is empty (the public op launches nothing)."""
        for name in self.LISTS:  # runs on every call: a plain loop costs half of any(map(...)) here (callgrind)
            if getattr(self, name):
                return False
        return True

    def tensor_args(self, outputs: bool) -> dict[str, Tensors | torch.Tensor | None]:
        """The tensor arguments (lists and single tensors, None where an optional one is absent) the op
        writes (`outputs`) or only reads, in schema order."""
        return {name: getattr(self, name) for name in self.TENSORS if (name in self.OUTPUTS) == outputs}

    def device(self) -> torch.device:
        """The device the public op dispatches on."""
        raise NotImplementedError

    def check(self) -> None:
        """Every rule of the op's binding (csrc/binding.cpp), in its order."""
        raise NotImplementedError

    def empty_result(self) -> object:
        """The public op's result when every list is empty (nothing to launch; the arguments are still checked)."""
        return None

    def fake_result(self) -> object:
        """The fake kernel's result: the outputs' metadata (nothing for the in-place ops)."""
        return None


@core_op
class Accumulate(CoreOp):
    """bufs[i] = (assign ? 0 : bufs[i]) + alpha * alpha_tensor * grads[i]."""

    NAME = "accumulate_"
    OUTPUTS = ("bufs",)
    IN_PLACE_PAIRS = True

    bufs: Tensors
    grads: Tensors
    alpha: float = 1.0
    alpha_tensor: torch.Tensor | None = None
    assign: bool = False

    def device(self) -> torch.device:
        return list_device(self.bufs or self.grads, self.alpha_tensor)

    def check(self) -> None:
        op, bufs, grads, alpha = self.op, self.bufs, self.grads, self.alpha
        if len(bufs) != len(grads):
            raise ValueError(f"{op}: bufs and grads must have the same length, got {len(bufs)} and {len(grads)}")
        device = list_device(bufs, self.alpha_tensor)
        check_list(op, "bufs", bufs, device)
        check_list(op, "grads", grads, device)
        for i, (b, g) in enumerate(zip(bufs, grads, strict=True)):
            check_same_shape(op, "grads", i, g, "bufs", b)
            ok = b.dtype in (torch.float32, g.dtype)
            check_pair_dtype(ok, op, "bufs", i, b, "grads", g, "float32 or its grad's dtype")
        if not math.isfinite(alpha):
            raise ValueError(f"{op}: alpha must be finite, got {num(alpha)}")
        if self.alpha_tensor is not None:
            check_scalar(op, "alpha_tensor", self.alpha_tensor, device)
        check_fits_float(op, "alpha", alpha)


@core_op
class AccumulateFinal(Accumulate):
    """A bucket of the window's last fold: accumulate_, found_inf raised on a non-finite result, and the
    results' partial norm (sum of squares for 2, max |x| for inf) added into norm_acc."""

    NAME = "accumulate_final_"
    OUTPUTS = ("bufs", "found_inf", "norm_acc")

    found_inf: torch.Tensor
    norm_acc: torch.Tensor
    norm_type: float = 2.0

    def device(self) -> torch.device:
        return list_device(self.bufs or self.grads, self.norm_acc)

    def check(self) -> None:
        super().check()
        device = list_device(list(self.bufs) or list(self.grads), self.norm_acc)
        check_scalar(self.op, "found_inf", self.found_inf, device)
        check_scalar(self.op, "norm_acc", self.norm_acc, device)
        check_fast_norm_type(self.op, float(self.norm_type))


@core_op
class GlobalNorm(CoreOp):
    """(total norm, per-tensor norms or an empty tensor): float32, float64 for a list holding float64."""

    NAME = "global_norm"

    tensors: Tensors
    norm_type: float = 2.0
    per_tensor: bool = False

    def device(self) -> torch.device:
        return list_device(self.tensors)

    def check(self) -> None:
        check_list(self.op, "tensors", self.tensors, list_device(self.tensors), use=Use.SINGLE_LIST)
        check_norm_type(self.op, float(self.norm_type))

    def _dtype(self) -> torch.dtype:
        return torch.float64 if any(t.dtype == torch.float64 for t in self.tensors) else torch.float32

    def empty_result(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros((), dtype=torch.float32), torch.zeros(0, dtype=torch.float32)

    def fake_result(self) -> tuple[torch.Tensor, torch.Tensor]:
        first, dtype = self.tensors[0], self._dtype()
        return first.new_empty((), dtype=dtype), first.new_empty((len(self.tensors) if self.per_tensor else 0,),
                                                                  dtype=dtype)  # fmt: skip


@core_op
class Unscale(CoreOp):
    """tensors *= inv_scale; found_inf = 1 if any input is non-finite."""

    NAME = "unscale_"
    OUTPUTS = ("tensors", "found_inf")

    tensors: Tensors
    inv_scale: torch.Tensor
    found_inf: torch.Tensor

    def device(self) -> torch.device:
        return list_device(self.tensors, self.found_inf)

    def check(self) -> None:
        device = self.device()
        check_list(self.op, "tensors", self.tensors, device)
        check_scalar(self.op, "inv_scale", self.inv_scale, device)
        check_scalar(self.op, "found_inf", self.found_inf, device)


@core_op
class ClipByNorm(CoreOp):
    """tensors *= min(1, max_norm / (total_norm + eps)), computed on the device."""

    NAME = "clip_by_norm_"
    OUTPUTS = ("tensors",)

    tensors: Tensors
    total_norm: torch.Tensor
    max_norm: float
    eps: float = DEFAULT_EPS

    def device(self) -> torch.device:
        return list_device(self.tensors, self.total_norm)

    def check(self) -> None:
        op, tensors, max_norm, eps = self.op, self.tensors, float(self.max_norm), float(self.eps)
        device = self.device()
        check_list(op, "tensors", tensors, device, use=Use.SINGLE_LIST)
        check_norm_scalar(op, self.total_norm, device)
        check_max_norm(op, max_norm)
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"{op}: eps must be finite and >= 0, got {num(eps)}")
        check_fits_float(op, "max_norm", max_norm, tensors)
        check_fits_float(op, "eps", eps, tensors)


@core_op
class ClipByValue(CoreOp):
    """tensors = clamp(tensors, -clip_value, clip_value): 0 zeroes, inf keeps, a negative value sets every
    element to it (torch.clamp); NaN is refused."""

    NAME = "clip_by_value_"
    OUTPUTS = ("tensors",)

    tensors: Tensors
    clip_value: float

    def device(self) -> torch.device:
        return list_device(self.tensors)

    def check(self) -> None:
        check_list(self.op, "tensors", self.tensors, self.device(), use=Use.SINGLE_LIST)
        if math.isnan(self.clip_value):
            raise ValueError(f"{self.op}: clip_value must not be NaN, got {num(self.clip_value)}")
        check_fits_float(self.op, "clip_value", float(self.clip_value), self.tensors)


CORE_RECORDS: tuple[type[CoreOp], ...] = (Accumulate, AccumulateFinal, GlobalNorm, Unscale, ClipByNorm, ClipByValue)
