"""Bad input of every fused optimizer op of the test table (_optim_inputs.OPTIMIZERS), both backends:
the exception type, a message naming the argument (torch.optim's wording for options), and no tensor
written (params, state, steps, flags)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import pytest
import torch
from _devices import require_ext
from _optim_inputs import OPTIMIZERS, OptimInfo, StepInputs, make_inputs
from _oracle import assert_bits_unchanged, assert_raise_alike, snapshot


@dataclass
class Call:
    """A valid call of either op; a case breaks one thing."""

    x: StepInputs
    device: str
    other: str
    options: dict = field(default_factory=dict)

    @classmethod
    def make(cls, device: str, gen: torch.Generator) -> Call:
        x = make_inputs([5, 12, 9], torch.float32, device, gen, amsgrad=True)
        options = {
            "lr": 1e-2,
            "grad_mult": torch.full((), 0.5, device=device),
            "found_inf": torch.zeros((), device=device),
        }
        return cls(x, device, "meta" if device == "cpu" else "cpu", options)

    def watched(self) -> list[torch.Tensor]:
        tensors = [*self.x.all_tensors(), *(v for v in self.options.values() if isinstance(v, torch.Tensor))]
        return [t for t in tensors if t.layout == torch.strided and t.device.type != "meta"]


def call(info: OptimInfo, c: Call, backend: str) -> None:
    options = {**({"momentum": 0.9} if info.name == "sgd" else {}), **c.options}
    lr = options.pop("lr")
    info.call(c.x, backend, lr, **options)


OPS = {info.name: partial(call, info) for info in OPTIMIZERS}
ALL = " ".join(OPS)  # the cases every optimizer shares
CASES: list = []


def case(ops: str, case_id: str, brk: Callable[[Call], None], exc: type[Exception], match: str) -> None:
    for op in ops.split():
        CASES.append(pytest.param(op, brk, exc, match, id=f"{op}-{case_id}"))


def option(name: str, value) -> Callable[[Call], None]:
    return lambda c: c.options.__setitem__(name, value)


def item(arg: str, make: Callable[[Call], torch.Tensor], index: int = 1) -> Callable[[Call], None]:
    def brk(c: Call) -> None:
        getattr(c.x, arg)[index] = make(c)

    return brk


for _lr in (-1e-3, float("nan"), float("inf")):
    case(ALL, f"lr={_lr}", option("lr", _lr), ValueError, "Invalid learning rate")
case(ALL, "weight_decay", option("weight_decay", -0.1), ValueError, "Invalid weight_decay value")
case("adamw", "eps", option("eps", -1e-8), ValueError, "Invalid epsilon value")
for _i, _betas in ((0, (1.0, 0.999)), (0, (-0.1, 0.999)), (1, (0.9, 1.0))):
    case("adamw lion", f"betas={_betas}", option("betas", _betas), ValueError, f"Invalid beta parameter at index {_i}")
case("sgd", "momentum", option("momentum", -0.5), ValueError, "Invalid momentum value")
case("sgd", "nesterov_dampening", lambda c: c.options.update(nesterov=True, dampening=0.1), ValueError, "Nesterov")
case("sgd", "momentum_without_buffers", lambda c: c.x.exp_avgs.clear(), ValueError, "momentum_buffers")
case(ALL, "mode", option("mode", "bf16"), ValueError, "mode must be one of")
case(ALL, "master_without_masters", option("mode", "master"), ValueError, "master_params")
case(ALL, "master_of_fp32_param", lambda c: c.x.master_params.extend(p.clone() for p in c.x.params),
     TypeError, r"master_params\[0\].*float16 or bfloat16")  # fmt: skip

# list lengths
case(ALL, "grads_shorter", lambda c: c.x.grads.pop(), ValueError, "grads must have one tensor per param")
case(ALL, "params_longer", lambda c: c.x.params.append(c.x.params[0].clone()), ValueError, "per param")
case("adamw", "exp_avg_sqs_longer", lambda c: c.x.exp_avg_sqs.append(c.x.exp_avg_sqs[0].clone()), ValueError,
     "exp_avg_sqs must have one tensor per param")  # fmt: skip
case("adamw", "max_exp_avg_sqs_shorter", lambda c: c.x.max_exp_avg_sqs.pop(), ValueError, "max_exp_avg_sqs")
case(ALL, "two_steps", lambda c: c.x.steps.pop(), ValueError, "steps must hold one tensor per param")
case("adamw", "no_steps", lambda c: c.x.steps.clear(), ValueError, "steps must hold")
case("lion", "stochastic_without_steps", lambda c: (c.x.steps.clear(), c.options.update(mode="stochastic")),
     ValueError, r"steps must hold .* shared by all, got 0")  # fmt: skip

# one bad tensor in a list
BAD_TENSORS = {
    "int32": (lambda c: torch.randint(-5, 5, (12,), dtype=torch.int32, device=c.device), TypeError, "dtype"),
    "sparse": (lambda c: torch.randn(12, device=c.device).to_sparse(), ValueError, "layout"),
    "strided": (lambda c: torch.randn(24, device=c.device)[::2], ValueError, "not contiguous"),
    # dense but permuted: the norms and clips take it (storage order), the steps pair lists element by element
    "transposed": (lambda c: torch.randn(4, 3, device=c.device).t(), ValueError, "not contiguous"),
    "other_device": (lambda c: torch.randn(12, device=c.other), ValueError, "is on"),
    "shape": (lambda c: torch.randn(3, 4, device=c.device), ValueError, "shape"),
}
for _arg in ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"):
    for _bad, (_make, _exc, _what) in BAD_TENSORS.items():
        if _arg == "params" and _bad == "shape":
            continue  # a param's shape is the reference, not checked
        _ops = ALL if _arg in ("params", "grads", "exp_avgs") else "adamw"
        _named = "(exp_avgs|momentum_buffers)" if _arg == "exp_avgs" else _arg  # SGD's name for the list
        case(_ops, f"{_arg}[1]-{_bad}", item(_arg, _make), _exc, rf"{_named}\[1\].*{_what}")
case(ALL, "grads[1]-float16", item("grads", lambda c: c.x.grads[1].half()), TypeError, r"grads\[1\].*float32")
case(ALL, "exp_avgs[1]-float16", item("exp_avgs", lambda c: c.x.exp_avgs[1].half()), TypeError,
     r"\[1\].*float32, bfloat16 or uint8 \(float64 for a float64 param\)")  # fmt: skip
# bfloat16 is a state storage (issue 30), but one storage per call
case(ALL, "exp_avgs[1]-bfloat16", item("exp_avgs", lambda c: c.x.exp_avgs[1].bfloat16()), TypeError,
     r"\[1\] has dtype torch.bfloat16 but .*; all state lists must share one storage")  # fmt: skip
case("adamw", "exp_avgs[1]-float64", item("exp_avgs", lambda c: c.x.exp_avgs[1].double()), TypeError, r"exp_avgs\[1\]")

# scalars: a one-element float32 tensor on the params' device
BAD_SCALARS = {
    "float64": (lambda c: torch.tensor(0.5, dtype=torch.float64, device=c.device), TypeError, "dtype"),
    "two_elements": (lambda c: torch.full((2,), 0.5, device=c.device), ValueError, "2 elements"),
    "other_device": (lambda c: torch.tensor(0.5, device=c.other), ValueError, "is on"),
}
for _name in ("lr", "grad_mult", "found_inf"):
    for _bad, (_make, _exc, _what) in BAD_SCALARS.items():
        _arg = "lr_tensor" if _name == "lr" else _name
        case(ALL, f"{_name}-{_bad}", lambda c, n=_name, m=_make: c.options.__setitem__(n, m(c)), _exc,
             rf"{_arg}.*{_what}")  # fmt: skip
    case(ALL, f"steps[2]-{_bad}", item("steps", _make, 2), _exc, rf"steps\[2\].*{_what}")


@pytest.mark.parametrize(("op", "brk", "exc", "match"), CASES)
def test_bad_input_is_rejected_and_nothing_is_written(device, backend, gen, op, brk, exc, match):
    c = Call.make(device, gen)
    brk(c)
    watched = c.watched()
    before = snapshot(watched)
    with pytest.raises(exc, match=match):
        OPS[op](c, backend)
    assert_bits_unchanged(before, watched, "inputs")


@pytest.mark.parametrize(("op", "brk", "exc", "match"), CASES)
def test_both_backends_raise_the_same_type_and_message(device, op, brk, exc, match):
    """The error contract of tests/ops/test_ops_errors.py for the steps: the compiled and the pure-PyTorch
    backends raise the same exception type with the same message, word for word (dtype names included)."""
    require_ext(device)

    def run(backend: str) -> None:
        c = Call.make(device, torch.Generator().manual_seed(0))
        brk(c)
        OPS[op](c, backend)

    assert_raise_alike([lambda: run("ext"), lambda: run("torch")], exc, match)


@pytest.mark.parametrize("op", list(OPS))
def test_the_valid_call_steps(device, backend, gen, op):
    """The unbroken call of the table does write: the cases fail for their one broken argument."""
    c = Call.make(device, gen)
    before = snapshot(c.x.params)
    OPS[op](c, backend)
    assert all(not torch.equal(b, a) for b, a in zip(before, snapshot(c.x.params), strict=True))
