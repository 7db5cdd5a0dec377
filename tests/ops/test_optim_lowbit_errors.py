"""Bad low-bit state input of the fused optimizer steps (LOWBIT_SPEC.md section 4), on both backends: the
same exception type and message, naming the argument, and nothing written (params, codes, scales, steps)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _devices import require_ext
from _lowbit_inputs import LowbitInputs, lowbit_inputs
from _optim_inputs import BY_NAME
from _oracle import assert_bits_unchanged, assert_raise_alike, snapshot

SIZES = [5, 300, 9]  # 1, 2 and 1 blocks
Break = Callable[[LowbitInputs, dict], None]  # breaks the inputs or the call's keywords in place
CASES: list = []


def case(case_id: str, brk: Break, exc: type[Exception], match: str, *, name: str = "adamw", storage: str = "int8",
         amsgrad: bool = False, param_dtype: torch.dtype = torch.float32) -> None:  # fmt: skip
    CASES.append(pytest.param(name, storage, amsgrad, param_dtype, brk, exc, match, id=case_id))


def set_scales(i: int, make: Callable[[torch.Tensor], torch.Tensor]) -> Break:
    """exp_avgs_scales[i] replaced by make(the valid one)."""
    return lambda x, kw: kw["exp_avgs_scales"].__setitem__(i, make(kw["exp_avgs_scales"][i]))


def set_state(slot: str, make: Callable[[torch.Tensor], torch.Tensor]) -> Break:
    """Every tensor of a state list replaced by make(it)."""
    return lambda x, kw: getattr(x.x, slot).__setitem__(slice(None), [make(t) for t in getattr(x.x, slot)])


def extra_scales(x: LowbitInputs, kw: dict) -> None:
    kw["exp_avgs_scales"] = [torch.zeros(-(-p.numel() // 256)) for p in x.x.params]


# fmt: off
# the scales lists: given exactly for int8 states, one 1-D contiguous float32 tensor per param
case("scales-missing", lambda x, kw: kw.pop("exp_avgs_scales"), ValueError,
     r"exp_avgs_scales must have one tensor per param \(3\) as exp_avgs is int8 \(uint8 codes\), got 0")
case("scales-short", lambda x, kw: kw["exp_avg_sqs_scales"].pop(), ValueError,
     r"exp_avg_sqs_scales must have one tensor per param \(3\).*got 2")
case("scales-numel", set_scales(1, lambda t: torch.zeros(3)), ValueError,
     r"exp_avgs_scales\[1\] has shape \[3\]; expected \[2\] \(one float32 absmax per 256 elements of params\[1\]\)")
case("scales-2d", set_scales(1, lambda t: t.view(1, 2)), ValueError, r"exp_avgs_scales\[1\] has shape \[1, 2\]")
case("scales-float64", set_scales(0, lambda t: t.double()), TypeError,
     r"exp_avgs_scales\[0\] has dtype torch.float64; expected float32")
case("scales-int32", set_scales(0, lambda t: t.int()), TypeError, r"exp_avgs_scales\[0\] has dtype torch.int32")
case("scales-strided", set_scales(1, lambda t: torch.zeros(4)[::2]), ValueError,
     r"exp_avgs_scales\[1\] is not contiguous")
case("scales-other-device", set_scales(2, lambda t: t.to("meta")), ValueError, r"exp_avgs_scales\[2\] is on meta")
case("scales-for-fp32-states", extra_scales, ValueError,
     r"exp_avgs_scales must be empty unless exp_avgs is int8 \(uint8 codes\), got 3 tensors", storage="fp32")
case("scales-for-bf16-states", extra_scales, ValueError, r"exp_avgs_scales must be empty unless", storage="bf16")
case("scales-for-unused-slot",
     lambda x, kw: kw.__setitem__("max_exp_avg_sqs_scales", [t.clone() for t in kw["exp_avgs_scales"]]),
     ValueError, r"max_exp_avg_sqs_scales must be empty unless max_exp_avg_sqs is int8")
case("scales-empty-tensor", set_scales(0, lambda t: torch.zeros(0)), ValueError, r"has shape \[0\]; expected \[1\]")
# the memory rule: scales are outputs
case("scales-share-memory", lambda x, kw: kw["exp_avg_sqs_scales"].__setitem__(1, kw["exp_avgs_scales"][1]),
     ValueError, r"exp_avgs_scales\[1\] and exp_avg_sqs_scales\[1\] share memory")
case("scales-view-of-params", lambda x, kw: kw["exp_avgs_scales"].__setitem__(0, x.x.params[0][:1]), ValueError,
     r"params\[0\] and exp_avgs_scales\[0\] share memory")
# one storage per call
case("mixed-storage", set_state("exp_avg_sqs", lambda t: torch.zeros(t.shape)), TypeError,
     r"exp_avg_sqs\[0\] has dtype torch.float32 but exp_avgs\[0\] has dtype torch.uint8; "
     r"all state lists must share one storage")
case("mixed-storage-bf16", set_state("exp_avgs", lambda t: t.float()), TypeError,
     r"exp_avg_sqs\[0\] has dtype torch.bfloat16 but exp_avgs\[0\] has dtype torch.float32", storage="bf16")
case("float16-state", set_state("exp_avgs", lambda t: t.half()), TypeError,
     r"exp_avgs\[0\] has dtype torch.float16 but params\[0\] has dtype torch.float32; expected float32, bfloat16 "
     r"or uint8 \(float64 for a float64 param\)", storage="bf16")
case("int8-amsgrad", lambda x, kw: None, ValueError,
     r"max_exp_avg_sqs is uint8 \(int8 states\), which amsgrad does not support; use bf16 or fp32 states for amsgrad",
     amsgrad=True)
case("float64-params-bf16", lambda x, kw: None, TypeError,
     r"exp_avgs\[0\] has dtype torch.bfloat16 but params\[0\] has dtype torch.float64; expected float32, "
     r"bfloat16 or uint8 \(float64 for a float64 param\)", storage="bf16", param_dtype=torch.float64)
case("float64-params-uint8", lambda x, kw: None, TypeError,
     r"exp_avgs\[0\] has dtype torch.uint8 but params\[0\] has dtype torch.float64", param_dtype=torch.float64)
case("bf16-without-steps", lambda x, kw: x.x.steps.clear(), ValueError,
     r"lion_step_: steps must be given for bfloat16 states", name="lion", storage="bf16")
# fmt: on


def _inputs(name: str, storage: str, amsgrad: bool, param_dtype: torch.dtype) -> LowbitInputs:
    """The valid call's inputs (the same on every call); float64 params get states of the given storage."""
    info, gen = BY_NAME[name], torch.Generator().manual_seed(30)
    if param_dtype == torch.float64:  # no valid low-bit call exists: convert a float32 one's states
        x = lowbit_inputs(info, {"amsgrad": amsgrad}, SIZES, storage, gen)
        x.x.params = [p.double() for p in x.x.params]
        x.x.grads = [g.double() for g in x.x.grads]
        return x
    if storage == "fp32":
        x = lowbit_inputs(info, {"amsgrad": amsgrad}, SIZES, "bf16", gen)
        x.x.exp_avgs, x.x.exp_avg_sqs = [t.float() for t in x.x.exp_avgs], [t.float() for t in x.x.exp_avg_sqs]
        return LowbitInputs(x.x, "fp32", [[], [], []])
    return lowbit_inputs(info, {"amsgrad": amsgrad}, SIZES, storage, gen)


@pytest.mark.parametrize(("name", "storage", "amsgrad", "param_dtype", "brk", "exc", "match"), CASES)
def test_bad_lowbit_input_is_refused_and_nothing_is_written(name, storage, amsgrad, param_dtype, brk, exc, match):
    require_ext("cpu")
    info = BY_NAME[name]

    def call(backend: str) -> Callable[[], None]:
        def run() -> None:
            x = _inputs(name, storage, amsgrad, param_dtype)
            kw = {k: list(v) for k, v in x.scales_kwargs(info).items()}
            brk(x, kw)
            watched = [t for t in (*x.all_tensors(), *(t for v in kw.values() for t in v)) if t.device.type == "cpu"]
            before = snapshot(watched)
            try:
                info.call(x.x, backend, info.lr, **({"amsgrad": True} if amsgrad else {}), **kw)
            finally:
                assert_bits_unchanged(before, watched, f"{backend} inputs")

        return run

    assert_raise_alike([call("ext"), call("torch")], exc, match)
