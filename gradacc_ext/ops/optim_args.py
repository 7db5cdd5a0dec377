"""The argument records of the fused optimizer steps: each op described once in Python.

One dataclass per op: the fields every step takes (OptimStep) and the op's own, its state lists
(``STATE``: name, optional; each with its int8 scales list ``<state>_scales``, ``SIGNED``: which code book)
and its scalar options (``OPTIONS``), from which its schema order follows,
as csrc/kernels/optim_traits.cuh generates the schema from the same names (tests/ops/test_ops_optim.py
holds them equal), so ``record.args()`` is the positional call of torch.ops.gradacc.<op> and
``Record.from_args(*args)`` reads one back. The checks (_checks_optim.check_step), the reference
(reference_optim), the fake kernels (_fake), the Python API (optim_api) and the host
emulation all take the record. A record also holds its op's option rules, with torch.optim's
wording and the number as C++ prints it, rule for rule those of the C++ traits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ._checks import num

Tensors = list[torch.Tensor]
MODES = {"nearest": 0, "master": 1, "stochastic": 2}
# The state storages (csrc/kernels/optim_params.h's StateStorage), by the state tensors' dtype.
STORAGES = {torch.float32: "fp32", torch.float64: "fp32", torch.bfloat16: "bf16", torch.uint8: "int8"}


def scales_name(state: str) -> str:
    """The int8 scales list of a state list (csrc/optim_args.h's ScalesNames)."""
    return f"{state}_scales"


def invalid(ok: bool, op: str | None, what: str, value: float) -> None:
    """torch.optim's "Invalid <what>: <value>" unless `ok`: named by the op with the number as C++ prints it
    (the binding's message), or with no op as torch.optim's constructors say it (the number as Python prints it)."""
    if not ok:
        raise ValueError(f"{op}: Invalid {what}: {num(value)}" if op else f"Invalid {what}: {value}")


def check_betas(betas: Sequence[float], op: str | None = None) -> None:
    """torch.optim's rule for betas (AdamW, Lion), its one home in Python: the records' option checks and the
    fused optimizers' constructors call it (csrc/kernels/optim_traits.cuh's check_betas is the C++ one)."""
    for index, beta in enumerate(betas):
        invalid(0.0 <= float(beta) < 1.0, op, f"beta parameter at index {index}", beta)


@dataclass(kw_only=True)
class OptimStep:
    """The arguments every optimizer op takes, and what each op's record answers.

    Schema order: params, grads, the state lists, their scales lists, master_params, steps, lr, lr_tensor,
    grad_mult, found_inf, the options (weight_decay among them), maximize, param_mode, seed. A scales list
    (``<state>_scales``, float32 block absmaxes) is given exactly when the states are int8 (uint8 codes).
    """

    NAME: ClassVar[str]  # the op's name in torch.ops.gradacc
    STATE: ClassVar[tuple[tuple[str, bool], ...]]  # (state list, optional), in the kernel's slot order
    SIGNED: ClassVar[tuple[bool, ...]]  # per slot: the int8 code book, signed (momenta) or unsigned
    NO_INT8: ClassVar[tuple[str | None, ...]]  # per slot: why it may not be int8 (the option it serves), or None
    OPTIONS: ClassVar[tuple[str, ...]]  # the optimizer's scalar options, in schema order

    params: Tensors
    grads: Tensors
    master_params: Tensors
    steps: Tensors
    lr: float
    lr_tensor: torch.Tensor | None
    grad_mult: torch.Tensor | None
    found_inf: torch.Tensor | None
    weight_decay: float
    maximize: bool
    param_mode: int
    seed: int

    @classmethod
    def schema_order(cls) -> tuple[str, ...]:
        """The op's argument names in its schema's order."""
        state = tuple(name for name, _ in cls.STATE)
        head = ("params", "grads", *state, *map(scales_name, state), "master_params", "steps")
        return (*head, "lr", "lr_tensor", "grad_mult", "found_inf", *cls.OPTIONS, "maximize", "param_mode", "seed")

    @classmethod
    def from_args(cls, *args: object) -> OptimStep:
        """The record of a positional call of the op."""
        return cls(**dict(zip(cls.schema_order(), args, strict=True)))

    @property
    def op(self) -> str:
        """The op as error messages name it."""
        return f"gradacc.{self.NAME}"

    def args(self) -> tuple:
        """The positional arguments of torch.ops.gradacc.<NAME>."""
        return tuple(getattr(self, name) for name in self.schema_order())

    def state(self) -> list[Tensors]:
        return [getattr(self, name) for name, _ in self.STATE]

    def scales(self) -> list[Tensors]:
        """The scales lists, in slot order (empty unless int8)."""
        return [getattr(self, scales_name(name)) for name, _ in self.STATE]

    def storage(self) -> str:
        """The call's state storage, "fp32", "bf16" or "int8": the first given state tensor's (the checks hold
        every other to it); "fp32" where no state is given."""
        for tensors in self.state():
            for t in tensors:
                if t is not None and t.dtype in STORAGES:
                    return STORAGES[t.dtype]
        return "fp32"

    def options(self) -> list[float]:
        return [float(getattr(self, name)) for name in self.OPTIONS]

    def check_options(self) -> None:
        """The option rules checked before any tensor (the C++ traits' check_options)."""

    def steps_required(self) -> bool:
        return True

    def check_state(self) -> None:
        """Rules on the state lists checked after them (the C++ traits' check_state)."""


@dataclass(kw_only=True)
class AdamWStep(OptimStep):
    """gradacc::adamw_step_: torch.optim.AdamW; amsgrad when max_exp_avg_sqs is given."""

    NAME = "adamw_step_"
    STATE = (("exp_avgs", False), ("exp_avg_sqs", False), ("max_exp_avg_sqs", True))
    SIGNED = (True, False, False)
    NO_INT8 = (None, None, "amsgrad")
    OPTIONS = ("beta1", "beta2", "eps", "weight_decay")

    exp_avgs: Tensors
    exp_avg_sqs: Tensors
    max_exp_avg_sqs: Tensors
    exp_avgs_scales: Tensors = field(default_factory=list)
    exp_avg_sqs_scales: Tensors = field(default_factory=list)
    max_exp_avg_sqs_scales: Tensors = field(default_factory=list)
    beta1: float
    beta2: float
    eps: float

    def check_options(self) -> None:
        invalid(math.isfinite(self.eps) and self.eps >= 0.0, self.op, "epsilon value", self.eps)
        check_betas((self.beta1, self.beta2), self.op)


@dataclass(kw_only=True)
class SGDStep(OptimStep):
    """gradacc::sgd_step_: torch.optim.SGD; momentum_buffers only with momentum."""

    NAME = "sgd_step_"
    STATE = (("momentum_buffers", True),)
    SIGNED = (True,)
    NO_INT8 = (None,)
    OPTIONS = ("momentum", "dampening", "weight_decay", "nesterov")

    momentum_buffers: Tensors
    momentum_buffers_scales: Tensors = field(default_factory=list)
    momentum: float
    dampening: float
    nesterov: bool

    def check_options(self) -> None:
        invalid(math.isfinite(self.momentum) and self.momentum >= 0.0, self.op, "momentum value", self.momentum)
        invalid(math.isfinite(self.dampening), self.op, "dampening value", self.dampening)
        if self.nesterov and (self.momentum <= 0.0 or self.dampening != 0.0):
            raise ValueError(f"{self.op}: Nesterov momentum requires a momentum and zero dampening")

    def steps_required(self) -> bool:
        # the first step is told by its count: momentum needs one, and stochastic rounding draws a
        # fresh stream per step
        return self.momentum != 0.0 or self.param_mode == MODES["stochastic"]

    def check_state(self) -> None:
        if self.momentum != 0.0 and self.params and not self.momentum_buffers:
            raise ValueError(f"{self.op}: momentum_buffers must be given when momentum != 0")


@dataclass(kw_only=True)
class LionStep(OptimStep):
    """gradacc::lion_step_: Lion (Chen et al. 2023, lion-pytorch's update); steps only for stochastic rounding."""

    NAME = "lion_step_"
    STATE = (("exp_avgs", False),)
    SIGNED = (True,)
    NO_INT8 = (None,)
    OPTIONS = ("beta1", "beta2", "weight_decay")

    exp_avgs: Tensors
    exp_avgs_scales: Tensors = field(default_factory=list)
    beta1: float
    beta2: float

    def check_options(self) -> None:
        check_betas((self.beta1, self.beta2), self.op)

    def steps_required(self) -> bool:
        return self.param_mode == MODES["stochastic"]  # its stream of random bits is per step


RECORDS: tuple[type[OptimStep], ...] = (AdamWStep, SGDStep, LionStep)
