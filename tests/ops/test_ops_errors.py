"""Bad input: every op, both backends. Each case asserts the exception type, a message naming the
argument, and that no tensor (buffer, grad, flag, norm, scale) was written."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import pytest
import torch
from _devices import require_ext
from _oracle import assert_bits_unchanged, assert_raise_alike, snapshot

import gradacc_ext
from gradacc_ext.ops import _checks_optim
from gradacc_ext.ops.core_args import Accumulate
from gradacc_ext.ops.optim_args import SGDStep


@dataclass
class Inputs:
    """Valid arguments of every op on `device`; a case breaks exactly one of them."""

    device: str
    other: str  # a device the lists are not on: meta beside the CPU, the CPU beside CUDA
    bufs: list = field(default_factory=list)
    grads: list = field(default_factory=list)
    tensors: list = field(default_factory=list)
    scale: object = 0.5
    found_inf: torch.Tensor | None = None
    norm_acc: torch.Tensor | None = None
    inv_scale: torch.Tensor | None = None
    total_norm: torch.Tensor | None = None
    norm_type: float = 2.0
    max_norm: float = 1.0
    eps: float = 1e-6
    clip_value: float = 1.0

    @classmethod
    def make(cls, device: str, gen: torch.Generator) -> Inputs:
        def r(shape, dtype):
            return torch.randn(shape, generator=gen).to(dtype).to(device)

        f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
        return cls(
            device=device,
            other="meta" if device == "cpu" else "cpu",
            bufs=[r(5, f32), r((4, 3), f32), r(9, f32)],
            grads=[r(5, bf16), r((4, 3), f16), r(9, f32)],
            tensors=[r(5, f32), r((4, 3), bf16), r(9, f16)],
            found_inf=torch.zeros(1, device=device),
            norm_acc=torch.full((), 7.0, device=device),
            inv_scale=torch.full((), 0.25, device=device),
            total_norm=torch.full((), 3.0, device=device),
        )

    def all_tensors(self) -> list[torch.Tensor]:
        out = [*self.bufs, *self.grads, *self.tensors]
        out += [getattr(self, f.name) for f in fields(self) if f.name in SCALAR_FIELDS]
        return [t for t in out if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta"]


SCALAR_FIELDS = ("scale", "found_inf", "norm_acc", "inv_scale", "total_norm")

OPS: dict[str, Callable[[Inputs, str], object]] = {
    "accumulate_": lambda a, be: gradacc_ext.accumulate_(a.bufs, a.grads, a.scale, backend=be),
    "accumulate_final_": lambda a, be: gradacc_ext.accumulate_final_(
        a.bufs, a.grads, a.found_inf, a.norm_acc, a.scale, norm_type=a.norm_type, backend=be
    ),
    "global_norm": lambda a, be: gradacc_ext.global_norm(a.tensors, a.norm_type, per_tensor=True, backend=be),
    "unscale_": lambda a, be: gradacc_ext.unscale_(a.tensors, a.inv_scale, a.found_inf, backend=be),
    "clip_by_norm_": lambda a, be: gradacc_ext.clip_by_norm_(a.tensors, a.total_norm, a.max_norm, a.eps, backend=be),
    "clip_by_value_": lambda a, be: gradacc_ext.clip_by_value_(a.tensors, a.clip_value, backend=be),
    "clip_grad_norm_": lambda a, be: gradacc_ext.clip_grad_norm_(a.tensors, a.max_norm, a.norm_type, a.eps, backend=be),
}

# ---- the cases: (op, how to break the inputs, exception, message pattern) -------------------------

Break = Callable[[Inputs], None]
CASES: list = []


def case(op: str, case_id: str, brk: Break, exc: type[Exception], match: str) -> None:
    CASES.append(pytest.param(op, brk, exc, match, id=f"{op}-{case_id}"))


def set_attr(name: str, value_of: Callable[[Inputs], object]) -> Break:
    return lambda a: setattr(a, name, value_of(a))


# A bad tensor at index 1 of a list argument (shape (4, 3) like its neighbours).
BAD_LIST_TENSORS: dict[str, tuple[Callable[[Inputs], torch.Tensor], type[Exception], str]] = {
    "int32": (lambda a: torch.randint(-5, 5, (4, 3), dtype=torch.int32, device=a.device), TypeError, "dtype"),
    "complex64": (lambda a: torch.randn(4, 3, dtype=torch.complex64, device=a.device), TypeError, "dtype"),
    "sparse": (lambda a: torch.randn(4, 3, device=a.device).to_sparse(), ValueError, "layout"),
    # every-other column: neither contiguous nor dense, so no op may read it as one block
    "strided": (lambda a: torch.randn(4, 6, device=a.device)[:, ::2], ValueError, "not (contiguous|dense)"),
    "other_device": (lambda a: torch.randn(4, 3, device=a.other), ValueError, "is on"),
    "None": (lambda a: None, ValueError, r"undefined \(None\)"),
}
# A transposed (dense, permuted) tensor is read in storage order by the single-list ops (norms, clips),
# which also take float64; the accumulate ops pair two lists element by element and unscale_ keeps the
# contiguous fp32/fp16/bf16 rule.
CONTIGUOUS_ONLY = ("accumulate_", "accumulate_final_", "unscale_")
LIST_ARGS = [
    ("accumulate_", "bufs"),
    ("accumulate_", "grads"),
    ("accumulate_final_", "bufs"),
    ("accumulate_final_", "grads"),
    ("global_norm", "tensors"),
    ("unscale_", "tensors"),
    ("clip_by_norm_", "tensors"),
    ("clip_by_value_", "tensors"),
    ("clip_grad_norm_", "tensors"),
]


def replace_item(arg: str, make: Callable[[Inputs], torch.Tensor]) -> Break:
    def brk(a: Inputs) -> None:
        getattr(a, arg)[1] = make(a)

    return brk


for _op, _arg in LIST_ARGS:
    for _bad, (_make, _exc, _what) in BAD_LIST_TENSORS.items():
        case(_op, f"{_arg}[1]-{_bad}", replace_item(_arg, _make), _exc, rf"{_arg}\[1\].*{_what}")
    if _op in CONTIGUOUS_ONLY:
        _transposed = replace_item(_arg, lambda a: torch.randn(3, 4, device=a.device).t())
        case(_op, f"{_arg}[1]-transposed", _transposed, ValueError, rf"{_arg}\[1\].*not contiguous")
        _f64 = replace_item(_arg, lambda a: torch.randn(4, 3, dtype=torch.float64, device=a.device))
        case(_op, f"{_arg}[1]-float64", _f64, TypeError, rf"{_arg}\[1\].*dtype torch.float64; expected float32, ")

# A scale, flag or norm tensor that is not a one-element float32 tensor on the lists' device.
BAD_SCALARS: dict[str, tuple[Callable[[Inputs], torch.Tensor], type[Exception], str]] = {
    "float64": (lambda a: torch.tensor(0.5, dtype=torch.float64, device=a.device), TypeError, "dtype"),
    "float16": (lambda a: torch.tensor(0.5, dtype=torch.float16, device=a.device), TypeError, "dtype"),
    "two_elements": (lambda a: torch.full((2,), 0.5, device=a.device), ValueError, "2 elements"),
    "no_elements": (lambda a: torch.empty(0, device=a.device), ValueError, "0 elements"),
    "other_device": (lambda a: torch.tensor(0.5, device=a.other), ValueError, "is on"),
}
# (op, field, the name the message uses): the public `scale` is the ops' alpha_tensor
SCALAR_ARGS = [
    ("accumulate_", "scale", "alpha_tensor"),
    ("accumulate_final_", "scale", "alpha_tensor"),
    ("accumulate_final_", "found_inf", "found_inf"),
    ("accumulate_final_", "norm_acc", "norm_acc"),
    ("unscale_", "inv_scale", "inv_scale"),
    ("unscale_", "found_inf", "found_inf"),
    ("clip_by_norm_", "total_norm", "total_norm"),
]
for _op, _field, _msg in SCALAR_ARGS:
    for _bad, (_make, _exc, _what) in BAD_SCALARS.items():
        if _field == "total_norm" and _bad in ("float64", "float16"):
            continue  # a clip's total_norm may have any float dtype (torch's get_total_norm returns the grads')
        case(_op, f"{_field}-{_bad}", set_attr(_field, _make), _exc, rf"{_msg}.*{_what}")
_int_norm = set_attr("total_norm", lambda a: torch.tensor(3, dtype=torch.int32, device=a.device))
case("clip_by_norm_", "total_norm-int32", _int_norm, TypeError, "total_norm.*dtype.*floating-point")

for _op in ("accumulate_", "accumulate_final_"):
    case(_op, "grads-longer", lambda a: a.grads.append(a.grads[0].clone()), ValueError, "same length")
    case(_op, "bufs-longer", lambda a: a.bufs.append(a.bufs[0].clone()), ValueError, "same length")
    case(
        _op,
        "grads[1]-shape",
        replace_item("grads", lambda a: a.grads[1].reshape(3, 4)),
        ValueError,
        r"grads\[1\].*shape",
    )
    case(_op, "grads[1]-rows", replace_item("grads", lambda a: a.grads[1][:2]), ValueError, r"grads\[1\].*shape")
    # a buffer must be fp32 or its grad's dtype: fp16 for a bf16 grad, bf16 for an fp32 grad
    for _i, _dtype in ((0, torch.float16), (2, torch.bfloat16)):

        def _narrow(a: Inputs, i: int = _i, dtype: torch.dtype = _dtype) -> None:
            a.bufs[i] = a.bufs[i].to(dtype)

        case(_op, f"bufs[{_i}]-{_dtype}", _narrow, TypeError, rf"bufs\[{_i}\].*float32 or its grad's dtype")
    for _alpha in (math.nan, math.inf, -math.inf):
        case(_op, f"alpha-{_alpha}", set_attr("scale", lambda a, v=_alpha: v), ValueError, "alpha must be finite")

# Every norm takes any order but NaN; accumulate_final_'s partials add for 2 and inf only (test_traps_ops.py).
for _op in ("global_norm", "clip_grad_norm_"):
    case(_op, "norm_type-nan", set_attr("norm_type", lambda a: math.nan), ValueError, "norm_type must be a number")
for _p in (math.nan, 1.0, -math.inf):
    case("accumulate_final_", f"norm_type-{_p}", set_attr("norm_type", lambda a, p=_p: p), ValueError,
         "norm_type must be 2.0 or inf")  # fmt: skip

for _op in ("clip_by_norm_", "clip_grad_norm_"):
    for _v in (-1.0, -math.inf, math.nan):  # 0 and inf are torch's "zero the grads" and "measure only"
        case(_op, f"max_norm-{_v}", set_attr("max_norm", lambda a, v=_v: v), ValueError, "max_norm must be >= 0")
    for _v in (-1e-6, math.nan, math.inf):
        case(_op, f"eps-{_v}", set_attr("eps", lambda a, v=_v: v), ValueError, "eps")

case("clip_by_value_", "clip_value-nan", set_attr("clip_value", lambda a: math.nan), ValueError, "clip_value")

# An output listed twice, or a leaf that requires grad as an output (ops/_aliasing.py; tests/ops/test_traps_ops.py).
for _op, _arg in [(op, arg) for op, arg in LIST_ARGS if arg != "grads" and op != "global_norm"]:
    _twice = replace_item(_arg, lambda a, arg=_arg: getattr(a, arg)[0])
    case(_op, f"{_arg}[1]-is-{_arg}[0]", _twice, ValueError, rf"{_arg}\[0\] and {_arg}\[1\] share memory")
    _leaf = replace_item(_arg, lambda a, arg=_arg: getattr(a, arg)[1].clone().requires_grad_())
    case(_op, f"{_arg}[1]-leaf-requires-grad", _leaf, RuntimeError, rf"{_arg}\[1\] is a leaf tensor that requires grad")


@pytest.mark.parametrize(("op", "brk", "exc", "match"), CASES)
def test_bad_input_is_rejected_and_nothing_is_written(device, backend, gen, op, brk, exc, match):
    inputs = Inputs.make(device, gen)
    brk(inputs)
    watched = inputs.all_tensors()
    before = snapshot(watched)
    with pytest.raises(exc, match=match):
        OPS[op](inputs, backend)
    assert_bits_unchanged(before, watched, "input tensors")


@pytest.mark.parametrize(("op", "brk", "exc", "match"), CASES)
def test_both_backends_raise_the_same_type_and_message(device, gen, op, brk, exc, match):
    """The error contract: for every bad input, the compiled and the pure-PyTorch backends raise the same
    exception type with the same message, word for word (dtype and layout names included)."""
    require_ext(device)

    def run(backend: str) -> None:
        inputs = Inputs.make(device, torch.Generator().manual_seed(0))
        brk(inputs)
        OPS[op](inputs, backend)

    assert_raise_alike([lambda: run("ext"), lambda: run("torch")], exc, match)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("bad", ["Ext", "cuda", ""])
def test_unknown_backend_is_rejected(device, gen, op, bad):
    inputs = Inputs.make(device, gen)
    watched = inputs.all_tensors()
    before = snapshot(watched)
    with pytest.raises(ValueError, match=r"backend must be one of"):
        OPS[op](inputs, bad)
    assert_bits_unchanged(before, watched, "input tensors")


@pytest.mark.parametrize("op", list(OPS))
def test_bad_arguments_are_rejected_with_empty_lists_too(device, gen, op):
    """An empty list (e.g. a rank without trainable params) must not hide a bad argument: a typo in
    backend= (or a NaN scale) would otherwise only surface on another rank or a later step."""
    inputs = Inputs.make(device, gen)
    inputs.bufs, inputs.grads, inputs.tensors = [], [], []
    with pytest.raises(ValueError, match=r"backend must be one of"):
        OPS[op](inputs, "Ext")
    if op in ("accumulate_", "accumulate_final_"):
        inputs.scale = math.nan
        with pytest.raises(ValueError, match=r"alpha must be finite"):
            OPS[op](inputs, "torch")


def test_ext_backend_without_kernels_for_the_device_is_an_error():
    """backend='ext' on a device without compiled kernels names the device instead of falling back."""
    t = [torch.empty(3, device="meta")]
    with pytest.raises(RuntimeError, match=r"backend='ext' requested for meta"):
        gradacc_ext.global_norm(t, backend="ext")


def sgd_record(t: dict) -> SGDStep:
    return SGDStep(params=t["params"], grads=t["grads"], momentum_buffers=t["bufs"], master_params=[],
                   steps=t["steps"], lr=0.1, lr_tensor=None, grad_mult=None, found_inf=None, momentum=0.9,
                   dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False, param_mode=0,
                   seed=0)  # fmt: skip


# (compiled op, its arguments, the Python validator of the same call) for lists `t` of CPU tensors.
CHECKED_CALLS = {
    "accumulate_": (
        lambda t: (t["bufs"], t["grads"], 0.5, None, False),
        lambda t: Accumulate(bufs=t["bufs"], grads=t["grads"], alpha=0.5).check(),
    ),
    "sgd_step_": (
        lambda t: sgd_record(t).args(),
        lambda t: _checks_optim.check_step(sgd_record(t)),
    ),
}


@pytest.mark.parametrize(("op", "arg", "named"), [
    ("accumulate_", "bufs", "bufs"), ("accumulate_", "grads", "grads"), ("sgd_step_", "params", "params"),
    ("sgd_step_", "grads", "grads"), ("sgd_step_", "bufs", "momentum_buffers"),
])  # fmt: skip
def test_compiled_device_message_is_the_python_one(gen, op, arg, named):
    """A meta tensor beside CPU ones dispatches to the Meta kernels, which run the Python checks, so the
    tables compare the binding's "is on" message only on CUDA; here the compiled CPU kernel is called past
    the Meta dispatch. One per-tensor check on each backend: lists and optimizer steps alike. The stable ABI
    carries every C++ error as a RuntimeError; its message is the Python check's, word for word (the public
    ops re-run the Python checks for the contract's type, see test_public_op_raises_the_contract_type)."""
    require_ext("cpu")
    t = {name: [torch.randn(4, generator=gen) for _ in range(3)] for name in ("bufs", "grads", "params")}
    t["steps"] = [torch.ones(())]
    t[arg][1] = torch.empty(4, device="meta")
    compiled_args, python_check = CHECKED_CALLS[op]
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    compiled = getattr(torch.ops.gradacc, op).default
    match = rf"{named}\[1\] is on meta but the tensors are on cpu"
    with pytest.raises(RuntimeError, match=match) as compiled_error:
        compiled.redispatch(keys, *compiled_args(t))
    with pytest.raises(ValueError, match=match) as python_error:
        python_check(t)
    assert str(compiled_error.value) == str(python_error.value)


def test_public_op_raises_the_contract_type(gen):
    """A check only the compiled kernel runs first (the public op validates in Python only after a failure)
    still raises the contract's ValueError / TypeError, with the binding's message."""
    require_ext("cpu")
    bufs, grads = [torch.randn(5, generator=gen)], [torch.randn(6, generator=gen)]
    with pytest.raises(ValueError, match=r"grads\[0\] has shape \[6\] but bufs\[0\] has shape \[5\]"):
        gradacc_ext.accumulate_(bufs, grads, 0.5)
    with pytest.raises(RuntimeError, match=r"grads\[0\] has shape \[6\]"):
        torch.ops.gradacc.accumulate_(bufs, grads, 0.5, None, False)
    with pytest.raises(TypeError, match=r"bufs\[0\] has dtype torch.float64"):
        gradacc_ext.accumulate_([torch.randn(5, dtype=torch.float64)], [torch.randn(5)], 0.5)
