"""Pure-PyTorch reference of the fused optimizer steps (gradacc::adamw_step_, sgd_step_, lion_step_).

Each takes the op's argument record (optim_args.py), with the ops' in-place semantics and their
arithmetic: torch.optim.AdamW / SGD operation by operation, each rounded on its own, in float32
(float64 for float64 params), with the per-tensor constants computed in float64 from the step count.
It is the fallback backend and the tests' oracle (on float64 inputs it computes in float64; ``compute=
torch.float64`` computes a float32 call's arithmetic in float64 too, int8 and bf16 states included).
The state storage is the record's (storage()): fp32 as is, bf16 stored with stochastic rounding from the
slot's own draw (csrc/kernels/quant_math.cuh's state_random_bits), int8 blocks (reference_lowbit.py).

Nothing here synchronises the host: lr, the grad multiplier, found_inf and the step counts
stay tensors, and a found_inf step writes back the values it read. It performs no argument
checks: gradacc_ext.ops.optim_api validates before calling it.
"""

from __future__ import annotations

import torch

from . import reference_lowbit
from .constants import HALF_DTYPES, state_dtype
from .optim_args import MODES, AdamWStep, LionStep, OptimStep, SGDStep

F64 = torch.float64
_CHUNK = 65536  # csrc/kernels/chunking.h: random positions are counted in chunks
_M64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 tensors holding uint64 bits."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """csrc/kernels/optim_math.cuh's splitmix64 on int64 tensors (wrapping arithmetic)."""
    x = x + _signed(0x9E3779B97F4A7C15)
    x = (x ^ _shr(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ _shr(x, 31)


def random_bits(seed: int, step: torch.Tensor, first: int, numel: int) -> torch.Tensor:
    """The 32 random bits of positions first .. first + numel - 1 at `step` (int64 tensor)."""
    seeded = splitmix64(torch.tensor(_signed(seed & _M64), dtype=torch.int64, device=step.device))
    stream = splitmix64(seeded ^ step.to(torch.int64))
    positions = torch.arange(first, first + numel, dtype=torch.int64, device=step.device)
    return _shr(splitmix64(stream + positions), 32)


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, r: torch.Tensor) -> torch.Tensor:
    """float32 x rounded to bf16/fp16, up with probability (x - down) / (up - down)."""
    x = x.reshape(-1)
    nearest = x.to(dtype)
    if dtype == torch.bfloat16:
        u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        b = _shr(u + (r & 0xFFFF), 16)
        out = torch.where(b >= 1 << 15, b - (1 << 16), b).to(torch.int16).view(torch.bfloat16)
        return torch.where(torch.isfinite(x), out, nearest)
    a = x.abs()
    nb = nearest.view(torch.int16).to(torch.int32) & 0xFFFF
    mag = nb & 0x7FFF
    fmag = mag.to(torch.int16).view(torch.float16).float()
    lo = torch.where(fmag > a, mag - 1, mag)
    hi = lo + 1
    flo = lo.to(torch.int16).view(torch.float16).float()
    fhi = hi.to(torch.int16).view(torch.float16).float()
    p_up = torch.where(torch.isfinite(fhi), (a - flo) / (fhi - flo), torch.zeros_like(a))
    u = (r >> 8).to(torch.float32) * 2.0**-24
    bits = (nb & 0x8000) | torch.where(u < p_up, hi, lo)
    out = torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(torch.float16)
    return torch.where(torch.isfinite(x) & (fmag != a), out, nearest)


def _scalar(t: torch.Tensor | None, device: torch.device, default: float = 1.0) -> torch.Tensor:
    return t.reshape(()).to(F64) if t is not None else torch.tensor(default, dtype=F64, device=device)


class _Step:
    """What every tensor of one call shares: the effective lr, the multiplier, the skip flag."""

    def __init__(self, a: OptimStep, compute: torch.dtype | None) -> None:
        device = a.params[0].device
        self.compute = compute
        self.storage, self.lists, self.scales, self.signed = a.storage(), a.state(), a.scales(), a.SIGNED
        self.steps, self.masters = a.steps, a.master_params
        self.lr = _scalar(a.lr_tensor, device) * a.lr
        self.mult = _scalar(a.grad_mult, device) * (-1.0 if a.maximize else 1.0)
        self.skip = (_scalar(a.found_inf, device, 0.0) != 0) if a.found_inf is not None else None
        self.mode, self.seed = a.param_mode, a.seed
        starts, total = [], 0
        for p in a.params:
            starts.append(total)
            total += -(-p.numel() // _CHUNK)
        self.chunk_starts = starts

    def dtype(self, param: torch.Tensor) -> torch.dtype:
        """The compute type of params[i]: its state dtype, unless the call asked for another."""
        return self.compute or state_dtype(param.dtype)

    def done(self, i: int) -> torch.Tensor:
        """Steps taken before this one by params[i], as float64."""
        if not self.steps:
            return torch.zeros((), dtype=F64, device=self.lr.device)
        return self.steps[0 if len(self.steps) == 1 else i].reshape(()).to(F64)

    def keep(self, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return new if self.skip is None else torch.where(self.skip, old, new)

    def write(self, state: torch.Tensor, value: torch.Tensor) -> None:
        """A state tensor's new value, unless the step is skipped."""
        state.copy_(self.keep(state, value))

    def load(self, i: int, param: torch.Tensor) -> torch.Tensor:
        if self.mode == MODES["master"]:
            return self.masters[i].to(self.dtype(param), copy=True)
        return param.to(self.dtype(param))

    def state(self, i: int, slot: int, dtype: torch.dtype) -> torch.Tensor:
        """State slot `slot` of params[i] in the compute type."""
        t = self.lists[slot][i]
        if self.storage == "int8":
            return reference_lowbit.decode(t, self.scales[slot][i], self.signed[slot], dtype)
        return t.to(dtype)

    def put(self, i: int, slot: int, value: torch.Tensor) -> None:
        """State slot `slot` of params[i]'s new value, stored in the call's storage unless the step is skipped."""
        t = self.lists[slot][i]
        if self.storage == "int8":
            codes, absmax = reference_lowbit.encode(value, self.signed[slot])
            self.write(t, codes)
            self.write(self.scales[slot][i], absmax)
            return
        if self.storage == "bf16":  # positions disjoint from the params': the slot in the top byte
            first = self.chunk_starts[i] * _CHUNK + ((slot + 1) << 56)
            value = stochastic_round(value.float(), torch.bfloat16, self.bits(i, first, t.numel())).view(t.shape)
        self.write(t, value)

    def bits(self, i: int, first: int, numel: int) -> torch.Tensor:
        """The random bits of params[i]'s step at positions first .. first + numel - 1."""
        return random_bits(self.seed, self.done(i) + 1, first, numel)

    def store(self, i: int, param: torch.Tensor, value: torch.Tensor) -> None:
        if self.mode == MODES["master"]:
            self.write(self.masters[i], value)
        if self.mode == MODES["stochastic"] and param.dtype in HALF_DTYPES:
            r = self.bits(i, self.chunk_starts[i] * _CHUNK, param.numel())
            value = stochastic_round(value.float(), param.dtype, r).view(param.shape)
        param.copy_(self.keep(param, value.to(param.dtype)))

    def finish(self) -> None:
        for s in self.steps:
            s.add_(1.0 if self.skip is None else (~self.skip).to(s.dtype))


def _lerp(start: torch.Tensor, end: torch.Tensor, weight: float) -> torch.Tensor:
    # torch's lerp formula, written out so no fused multiply-add can enter
    if weight < 0.5:
        return start + weight * (end - start)
    return end - (end - start) * (1.0 - weight)


def adamw_step_(a: AdamWStep, *, compute: torch.dtype | None = None) -> None:
    if not a.params:
        return
    run = _Step(a, compute)
    beta1, beta2, eps, weight_decay = a.beta1, a.beta2, a.eps, a.weight_decay
    for i, param in enumerate(a.params):
        dtype = run.dtype(param)
        step = run.done(i) + 1
        step_size = (run.lr / (1.0 - beta1**step)).to(dtype)
        bc2_sqrt = (1.0 - beta2**step).sqrt().to(dtype)
        decay = (1.0 - run.lr * weight_decay).to(dtype)
        g = a.grads[i].to(dtype) * run.mult.to(dtype)
        p = run.load(i, param) * decay
        m = _lerp(run.state(i, 0, dtype), g, 1.0 - beta1)
        v = run.state(i, 1, dtype) * beta2 + (g * g) * (1.0 - beta2)
        second = v
        if a.max_exp_avg_sqs:
            second = torch.maximum(run.state(i, 2, dtype), v)
            run.put(i, 2, second)
        denom = second.sqrt() / bc2_sqrt + eps
        p = p - step_size * (m / denom)
        run.put(i, 0, m)
        run.put(i, 1, v)
        run.store(i, param, p)
    run.finish()


def sgd_step_(a: SGDStep, *, compute: torch.dtype | None = None) -> None:
    if not a.params:
        return
    run = _Step(a, compute)
    momentum, weight_decay = a.momentum, a.weight_decay
    for i, param in enumerate(a.params):
        dtype = run.dtype(param)
        p = run.load(i, param)
        g = a.grads[i].to(dtype) * run.mult.to(dtype)
        if weight_decay != 0.0:
            g = g + weight_decay * p
        if momentum != 0.0:
            old = run.state(i, 0, dtype)
            buf = torch.where(run.done(i) == 0, g, old * momentum + g * (1.0 - a.dampening))
            run.put(i, 0, buf)
            g = g + momentum * buf if a.nesterov else buf
        run.store(i, param, p + (-run.lr).to(dtype) * g)
    run.finish()


def lion_step_(a: LionStep, *, compute: torch.dtype | None = None) -> None:
    """lion-pytorch's update: decay, the sign of the interpolated momentum, then the momentum."""
    if not a.params:
        return
    run = _Step(a, compute)
    for i, param in enumerate(a.params):
        dtype = run.dtype(param)
        decay = (1.0 - run.lr * a.weight_decay).to(dtype)
        g = a.grads[i].to(dtype) * run.mult.to(dtype)
        p = run.load(i, param) * decay
        m = run.state(i, 0, dtype)
        direction = (m * a.beta1 + g * (1.0 - a.beta1)).sign()
        run.put(i, 0, m * a.beta2 + g * (1.0 - a.beta2))
        run.store(i, param, p - run.lr.to(dtype) * direction)
    run.finish()
