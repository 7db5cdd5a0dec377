"""The tensors one benchmark cell works on, filled with random data.

Data is never all-zero: buffers and grads are random normal at the loss scale,
parameters random normal. The constants keep every operation at a numeric
fixed point when it is repeated hundreds of times on the same tensors, so the
timed work neither overflows nor decays into subnormals (which are slow on CPUs):

* accumulate: buf += grad grows linearly, by one loss scale per repeat;
* final tail: (buf + grad) / LOSS_SCALE has variance >= 1, so its norm exceeds
  max_norm = CLIP_FRACTION * sqrt(numel) and every repeat really clips,
  landing back near variance CLIP_FRACTION**2;
* clip alone: the given norm makes the coefficient CLIP_ALONE_COEF < 1, so every
  repeat multiplies (a coefficient >= 1 is skipped by the kernels) and a
  thousand repeats shrink the data by only e**-1;
* unscale alone: inv_scale is -1, a real multiply whose repeats keep every
  magnitude (torch's kernel may skip a multiply by 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .operations import Operation
from .workloads import Workload

LOSS_SCALE = 1024.0
CLIP_FRACTION = 0.5
CLIP_ALONE_COEF = 0.999
ADAMW_LR = 1e-4
UNSCALE_ALONE_INV_SCALE = -1.0
ALIGN_BYTES = 64
POOL = 1 << 16  # random values drawn per list; repeated over longer lists


@dataclass
class GradState:
    bufs: list[torch.Tensor]  # accumulation buffers (fp32; op.buf_dtype for unscale alone), also the params' .grad
    grads: list[torch.Tensor]  # this micro-step's (loss-scaled) grads; empty when the op reads none
    # Empty unless an implementation needs p.grad or an optimizer. Without an optimizer nothing reads
    # their data: each is then a zero-stride view of one element (no memory), holding .grad only.
    params: list[torch.nn.Parameter]
    found_inf: torch.Tensor
    inv_scale: torch.Tensor
    norm_out: torch.Tensor
    clip_norm: torch.Tensor  # the given total norm of "clip alone"
    max_norm: float
    optimizer: torch.optim.Optimizer | None = None
    _snapshot: list[torch.Tensor] = field(default_factory=list, repr=False)

    def mutable(self) -> list[torch.Tensor]:
        params = self.params if self.optimizer is not None else []  # only an optimizer writes them
        return [*self.bufs, *params, self.found_inf, self.norm_out]

    def snapshot(self) -> None:
        """Remembers every tensor an implementation may write (see restore)."""
        with torch.no_grad():
            self._snapshot = [t.detach().clone() for t in self.mutable()]

    def restore(self) -> None:
        """Puts back the snapshot in place (tensor identities unchanged) and forgets optimizer state."""
        with torch.no_grad():
            for t, saved in zip(self.mutable(), self._snapshot, strict=True):
                t.copy_(saved)
        if self.optimizer is not None:
            self.optimizer.state.clear()

    def drop_snapshot(self) -> None:
        self._snapshot = []

    def outputs(self, returned: torch.Tensor | None) -> dict[str, list[torch.Tensor]]:
        """Copies of everything the operation produced, for comparing implementations."""
        with torch.no_grad():
            out = {"bufs": [b.clone() for b in self.bufs], "found_inf": [self.found_inf.clone()]}
            if self.optimizer is not None:
                out["params"] = [p.detach().clone() for p in self.params]
            if returned is not None:
                out["returned"] = [returned.detach().clone().reshape(())]
        return out


def needs_params(op: Operation, impls: tuple[str, ...] = ("eager",)) -> bool:
    """AdamW needs params; torch's clip_grad_norm_ / clip_grads_with_norm_ (eager, compile) read p.grad."""
    torch_clip = op.key in ("tail", "clip") and any(name in ("eager", "compile") for name in impls)
    return op.needs_optimizer or torch_clip


def normal_tensors(
    shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, std: float, device: torch.device, gen: torch.Generator
) -> list[torch.Tensor]:
    """Random normal tensors of `shapes`, carved from one allocation at 64-byte-aligned offsets.

    Filling 2,000 tiny tensors one by one, and drawing every element of the input sets
    (hundreds of MiB per cell), took most of a `gradacc bench` run. So: one allocation per
    list, split in one call; POOL random values drawn and repeated over longer lists (the
    timing needs distinct memory, not distinct values). Offsets are aligned as separate
    allocations would be.
    """
    align = max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
    sizes = []
    for shape in shapes:
        numel = math.prod(shape)
        sizes += [numel, -numel % align]  # the tensor, then padding up to the next aligned offset
    total = sum(sizes)
    pool = torch.empty(min(total, POOL), dtype=dtype, device=device).normal_(0.0, std, generator=gen)
    flat = pool.repeat(-(-total // pool.numel()))[:total]
    pieces = flat.split(sizes)[::2]
    return [t if t.dim() == len(s) else t.view(s) for t, s in zip(pieces, shapes, strict=True)]


def make_state(
    workload: Workload, op: Operation, device: torch.device | str, seed: int, with_params: bool | None = None
) -> GradState:
    """Random inputs of `op` on `workload`; params only if with_params (default: needs_params(op))."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(dtype: torch.dtype, std: float) -> list[torch.Tensor]:
        return normal_tensors(workload.shapes, dtype, std, device, gen)

    bufs = normal(op.buf_dtype, LOSS_SCALE)
    grads = normal(op.grad_dtype, LOSS_SCALE) if op.grad_dtype is not None else []
    params: list[torch.nn.Parameter] = []
    if needs_params(op) if with_params is None else with_params:
        if op.needs_optimizer:
            data = normal(torch.float32, 0.02)
        else:  # only .grad is read (torch's clipping): no memory for the data
            zero = torch.zeros((), dtype=torch.float32, device=device)
            data = [zero.expand(shape) for shape in workload.shapes]
        for p_data, buf in zip(data, bufs, strict=True):
            p = torch.nn.Parameter(p_data)
            p.grad = buf
            params.append(p)
    max_norm = CLIP_FRACTION * math.sqrt(workload.numel)
    optimizer = None
    if op.needs_optimizer:
        fused = device.type == "cuda"  # fused=True on CUDA, foreach on CPU (as the issue asks)
        optimizer = torch.optim.AdamW(params, lr=ADAMW_LR, fused=fused or None, foreach=None if fused else True)
    scalar = {"dtype": torch.float32, "device": device}
    return GradState(
        bufs=bufs,
        grads=grads,
        params=params,
        found_inf=torch.zeros(1, **scalar),
        inv_scale=torch.full((1,), UNSCALE_ALONE_INV_SCALE if op.unscale_alone else 1.0 / LOSS_SCALE, **scalar),
        norm_out=torch.zeros(1, **scalar),
        clip_norm=torch.full((), max_norm / CLIP_ALONE_COEF, **scalar),  # 0-d: torch's clip wants it
        max_norm=max_norm,
        optimizer=optimizer,
    )
