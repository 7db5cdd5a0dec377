"""The kernels `gradacc selftest` checks, as a table: one entry per compiled kernel.

Each entry runs its op on inputs drawn from an Inputs and returns every tensor the op wrote, once
with the compiled kernels (backend "ext", on the device under test) and once with the pure-PyTorch
reference (backend "torch", on the CPU); selftest.py compares the two. An op added later (a new
optimizer step) is one more Kernel in KERNELS: a run function and its cases.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import ops
from ..ops import reference_lowbit

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
MIXED = "mixed"  # a list alternating fp32, fp16 and bf16 tensors
ODD_SIZES = [1, 7, 4099, 65537]  # odd, and across the kernels' 64 Ki-element chunks
MANY = 1400  # more tensors than one launch's 32 KB of metadata holds
LAYOUTS = ("odd", "unaligned", "many")


class Inputs:
    """Random tensors for one (kernel, case, layout), identical for both backends: each run starts a
    fresh generator from the same seed. Layouts: "odd" sizes, "unaligned" views (one element past
    the allocation's start) and "many" small tensors."""

    def __init__(self, device: str, layout: str, seed: int) -> None:
        self.device, self.layout = device, layout
        self.gen = torch.Generator().manual_seed(seed)
        many = torch.randint(1, 17, (MANY,), generator=self.gen).tolist()
        self.sizes: list[int] = many if layout == "many" else ODD_SIZES

    def tensor(self, n: int, dtype: torch.dtype, positive: bool = False) -> torch.Tensor:
        x = torch.randn(n + 1, generator=self.gen)
        x = (x.abs() if positive else x).to(dtype).to(self.device)
        return x[1:] if self.layout == "unaligned" else x[:n]

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` on the device, one element past its allocation's start in the "unaligned" layout."""
        if self.layout != "unaligned":
            return t.to(self.device, copy=True)
        return torch.empty(t.numel() + 1, dtype=t.dtype, device=self.device)[1:].copy_(t.reshape(-1))

    def tensors(self, dtype: torch.dtype | str, positive: bool = False) -> list[torch.Tensor]:
        """One tensor per size; dtype MIXED cycles through fp32, fp16 and bf16."""
        cycle = (F32, F16, BF16) if dtype == MIXED else (dtype,)
        return [self.tensor(n, cycle[i % len(cycle)], positive) for i, n in enumerate(self.sizes)]

    def scalar(self, value: float, shape: tuple[int, ...] = ()) -> torch.Tensor:
        return torch.full(shape, value, dtype=F32, device=self.device)


Run = Callable[[Inputs, str, str], list[torch.Tensor]]  # (inputs, case, backend) -> every tensor the op wrote


@dataclass(frozen=True)
class Kernel:
    """One compiled kernel: `run` calls it for a case of `cases`. A 16-bit result may differ from the
    reference by one ulp; `max_bits_differ` bounds the fraction of 16-bit params whose bits differ
    (the optimizer steps' rounding must agree but where the fp32 update differs in its last bit)."""

    name: str
    cases: dict[str, object]
    run: Run
    max_bits_differ: float | None = None


# (buffer dtype, grad dtype) pairs the paired ops take: fp32 buffers for any grad, or the grad's own dtype
PAIRS = {"fp32<fp32": (F32, F32), "fp32<fp16": (F32, F16), "fp32<bf16": (F32, BF16), "fp32<mixed": (F32, MIXED),
         "fp16<fp16": (F16, F16), "bf16<bf16": (BF16, BF16)}  # fmt: skip
SINGLE = {"fp32": F32, "fp16": F16, "bf16": BF16, MIXED: MIXED}
SINGLE_F64 = {**SINGLE, "fp64": F64}  # the norm and clip ops take float64 lists too


def _accumulate(x: Inputs, case: str, backend: str) -> list[torch.Tensor]:
    buf_dtype, grad_dtype = PAIRS[case]
    bufs, grads = x.tensors(buf_dtype), x.tensors(grad_dtype)
    ops.accumulate_(bufs, grads, 0.5, backend=backend)
    first = x.tensors(buf_dtype)
    ops.accumulate_(first, grads, x.scalar(0.25, (1,)), assign=True, backend=backend)  # device scale, assign
    return bufs + first


def _accumulate_final(x: Inputs, case: str, backend: str) -> list[torch.Tensor]:
    """Two buckets of a last fold adding into one running sum of squares (from 0.5), and an inf partial."""
    buf_dtype, grad_dtype = PAIRS[case]
    bufs, grads, more = x.tensors(buf_dtype), x.tensors(grad_dtype), x.tensors(buf_dtype)
    found, sumsq, peak = x.scalar(0.0, (1,)), x.scalar(0.5), x.scalar(0.5)
    half = len(bufs) // 2
    ops.accumulate_final_(bufs[:half], grads[:half], found, sumsq, 0.5, backend=backend)
    ops.accumulate_final_(bufs[half:], grads[half:], found, sumsq, x.scalar(0.25, (1,)), assign=True, backend=backend)
    ops.accumulate_final_(more, grads, found, peak, 0.5, norm_type=float("inf"), backend=backend)
    return [*bufs, *more, found, sumsq, peak]


def _global_norm(x: Inputs, case: str, backend: str) -> list[torch.Tensor]:
    tensors = x.tensors(SINGLE_F64[case])
    l2 = ops.global_norm(tensors, 2.0, per_tensor=True, backend=backend)
    inf = ops.global_norm(tensors, float("inf"), per_tensor=True, backend=backend)
    return [*l2, *inf]


def _unscale(x: Inputs, case: str, backend: str) -> list[torch.Tensor]:
    tensors, found = x.tensors(SINGLE[case]), x.scalar(0.0, (1,))
    ops.unscale_(tensors, x.scalar(0.5), found, backend=backend)
    return [*tensors, found]


def _clip_by_norm(x: Inputs, case: str, backend: str) -> list[torch.Tensor]:
    tensors = x.tensors(SINGLE_F64[case])
    ops.clip_by_norm_(tensors, x.scalar(4.0), 1.5, backend=backend)
    return tensors


def _clip_by_value(x: Inputs, case: str, backend: str) -> list[torch.Tensor]:
    tensors = x.tensors(SINGLE_F64[case])
    ops.clip_by_value_(tensors, 0.5, backend=backend)
    return tensors


# param dtype, grad dtype (16-bit params read fp32 accumulation buffers), storage mode
OPTIM_CASES = {
    "fp32": (F32, F32, "nearest"),
    "bf16-master": (BF16, F32, "master"),
    "bf16-stochastic": (BF16, F32, "stochastic"),
    "fp16": (F16, F16, "nearest"),
    "fp64": (F64, F64, "nearest"),
}
# the state storages (issue 30): bf16 and int8 states, with fp32 params and bf16 ones in stochastic rounding
LOWBIT_CASES = {
    "fp32-bf16-states": (F32, F32, "nearest"),
    "fp32-int8-states": (F32, F32, "nearest"),
    "bf16-stochastic-bf16-states": (BF16, F32, "stochastic"),
    "bf16-stochastic-int8-states": (BF16, F32, "stochastic"),
}
# the steps' other switches, on fp32: AdamW's amsgrad, SGD's nesterov, all maximizing
ADAMW_CASES = {**OPTIM_CASES, "fp32-amsgrad-maximize": (F32, F32, "nearest"), **LOWBIT_CASES}
SGD_CASES = {**OPTIM_CASES, "fp32-nesterov-maximize": (F32, F32, "nearest"), **LOWBIT_CASES}
LION_CASES = {**OPTIM_CASES, "fp32-maximize": (F32, F32, "nearest"), **LOWBIT_CASES}


def _optim_inputs(x: Inputs, case: str) -> tuple[list[torch.Tensor], ...]:
    """(params, grads, first moments, second moments, fp32 master params or [], step counts, scalars)."""
    param_dtype, grad_dtype, mode = {**ADAMW_CASES, **SGD_CASES, **LION_CASES}[case]
    state = F64 if param_dtype == F64 else F32
    params, grads = x.tensors(param_dtype), x.tensors(grad_dtype)
    masters = [p.to(F32) for p in params] if mode == "master" else []
    steps = [x.scalar(float(i % 3), (1,)) for i in range(len(params))]  # 0: a param's first step
    scalars = [x.scalar(1e-2), x.scalar(0.75), x.scalar(0.0, (1,))]  # lr, grad_mult, found_inf
    return params, grads, x.tensors(state), x.tensors(state, positive=True), masters, steps, scalars


def _stored(x: Inputs, case: str, states: list[torch.Tensor], signed: bool) -> tuple[list, list]:
    """(states, scales) in the case's storage: as drawn (fp32), bf16, or int8 codes with their block absmaxes
    (encoded by the reference); the layout's placement kept."""
    if "-states" not in case:
        return states, []
    if "bf16-states" in case:
        return [x.place(t.to(BF16)) for t in states], []
    encoded = [reference_lowbit.encode(t.cpu(), signed) for t in states]
    return [x.place(codes) for codes, _ in encoded], [x.place(absmax) for _, absmax in encoded]


def _adamw(x: Inputs, case: str, backend: str) -> list[torch.Tensor]:
    params, grads, m, v, masters, steps, (lr, mult, found) = _optim_inputs(x, case)
    max_v = x.tensors(v[0].dtype, positive=True) if "amsgrad" in case else []  # above v here, below there
    (m, m_scales), (v, v_scales) = _stored(x, case, m, True), _stored(x, case, v, False)
    ops.adamw_step_(params, grads, m, v, steps, lr=lr, weight_decay=0.1, max_exp_avg_sqs=max_v, master_params=masters,
                    exp_avgs_scales=m_scales, exp_avg_sqs_scales=v_scales, grad_mult=mult, found_inf=found,
                    maximize="maximize" in case, mode=ADAMW_CASES[case][2], seed=7, backend=backend)  # fmt: skip
    return [*params, *m, *v, *max_v, *m_scales, *v_scales, *masters, *steps]


def _sgd(x: Inputs, case: str, backend: str) -> list[torch.Tensor]:
    params, grads, momentum, _, masters, steps, (lr, mult, found) = _optim_inputs(x, case)
    momentum, scales = _stored(x, case, momentum, True)
    ops.sgd_step_(params, grads, lr=lr, momentum=0.9, weight_decay=0.01, nesterov="nesterov" in case,
                  momentum_buffers=momentum, momentum_buffers_scales=scales, steps=steps, master_params=masters,
                  grad_mult=mult, found_inf=found, maximize="maximize" in case, mode=SGD_CASES[case][2], seed=7,
                  backend=backend)  # fmt: skip
    return [*params, *momentum, *scales, *masters, *steps]


def _lion(x: Inputs, case: str, backend: str) -> list[torch.Tensor]:
    params, grads, m, _, masters, steps, (lr, mult, found) = _optim_inputs(x, case)
    m, scales = _stored(x, case, m, True)
    ops.lion_step_(params, grads, m, lr=lr, weight_decay=0.1, exp_avgs_scales=scales, steps=steps,
                   master_params=masters, grad_mult=mult, found_inf=found, maximize="maximize" in case,
                   mode=LION_CASES[case][2], seed=7, backend=backend)  # fmt: skip
    return [*params, *m, *scales, *masters, *steps]


KERNELS: list[Kernel] = [
    Kernel("accumulate_", PAIRS, _accumulate),
    Kernel("accumulate_final_", PAIRS, _accumulate_final),
    Kernel("global_norm", SINGLE_F64, _global_norm),
    Kernel("unscale_", SINGLE, _unscale),
    Kernel("clip_by_norm_", SINGLE_F64, _clip_by_norm),
    Kernel("clip_by_value_", SINGLE_F64, _clip_by_value),
    Kernel("adamw_step_", ADAMW_CASES, _adamw, max_bits_differ=1e-3),
    Kernel("sgd_step_", SGD_CASES, _sgd, max_bits_differ=1e-3),
    Kernel("lion_step_", LION_CASES, _lion, max_bits_differ=1e-3),
]
