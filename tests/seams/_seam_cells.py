"""One seam cell's pieces: the tiny model with its event injector, the samples, the optimizer, the config and
the plain loop it must equal.

The plain loop runs on one process over the same samples: for each window, every rank's shard of every
micro-batch goes through backward with its loss divided by (micro-batches in the window x ranks), a power
of two, so the low-precision paths round each shard's gradient exactly as the accumulator's micro-steps do
and only fp32 summation order differs. The fp32 path runs in float64.
"""

from __future__ import annotations

import contextlib
import time

import torch
from _cases import OOMInBackward
from _seam_states import hidden_width, optimizer_options, reference_params
from _seam_table import FSDP_MODES, Cell

IN, HIDDEN, OUT = 5, 6, 3
ROWS = 4  # rows per rank per micro-batch (the adaptive path splits them into chunks of CHUNK)
CHUNK = 2
WINDOW = 2  # micro-batches per window: a power of two, so 1/window scales exactly
FULL, SHORT = 6, 7  # micro-batches: three whole windows, or a short last window of one
EVENT_AT = 1  # the micro-batch (or adaptive chunk, counted in forwards) where an event fires: it closes window 0
CHECKPOINT_AT = 3  # micro-batches before the mid-window checkpoint (window 1 holds one)
CLIP, SEED, INIT_SCALE = 0.5, 27, 2.0**10
SLOW_S = 1.0  # the slow peer's extra time in one forward; the peer watch's stall limit is shortened below it
TOL = {True: dict(rtol=1e-9, atol=1e-11), False: dict(rtol=1e-4, atol=1e-5)}  # float64 / fp32 (tests/_dist.py)


class Injector(torch.nn.Module):
    """An identity between the two Linears that fires the cell's event on one forward call (counted from 0):
    an OOM in forward, an OOM in backward (after the last Linear's gradients are produced), or a sleep."""

    def __init__(self, event: str, rank: int) -> None:
        super().__init__()
        self.event, self.rank, self.calls = event, rank, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        call, self.calls = self.calls, self.calls + 1
        if call != EVENT_AT:
            return x
        if self.event == "oom_forward":
            raise torch.OutOfMemoryError("seam matrix: injected OOM in forward")
        if self.event == "slow_peer" and self.rank == 0:
            time.sleep(SLOW_S)
        if self.event == "oom_backward":
            return OOMInBackward.apply(x)
        return x


def low_precision(cell: Cell) -> bool:
    return cell.precision != "fp32"


def model_dtype(cell: Cell) -> torch.dtype:
    return torch.float32 if low_precision(cell) else torch.float64


def make_model(cell: Cell, rank: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(SEED)
    width = hidden_width(cell, HIDDEN)
    layers = [torch.nn.Linear(IN, width), torch.nn.Tanh(), Injector(cell.event, rank), torch.nn.Linear(width, OUT)]
    return torch.nn.Sequential(*layers).to(model_dtype(cell))


def samples(cell: Cell, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global micro-batches (world x ROWS rows each); rank r holds rows r*ROWS:(r+1)*ROWS."""
    g = torch.Generator().manual_seed(SEED + 1)
    count = SHORT if cell.event == "short_window" else FULL
    dtype = model_dtype(cell)
    rows = world * ROWS
    return [
        (torch.randn(rows, IN, generator=g, dtype=dtype), torch.randn(rows, OUT, generator=g, dtype=dtype))
        for _ in range(count)
    ]


def shard(batch: tuple[torch.Tensor, torch.Tensor], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(t[rank * ROWS : (rank + 1) * ROWS] for t in batch)


def make_optimizer(cell: Cell, params) -> torch.optim.Optimizer:
    from gradacc_ext.optim import FusedAdamW, FusedLion

    if cell.optimizer == "fused_adamw":
        return FusedAdamW(params, lr=0.03, weight_decay=0.1, **optimizer_options(cell))
    if cell.optimizer == "fused_lion":
        return FusedLion(params, lr=3e-3, weight_decay=0.1, **optimizer_options(cell))
    if cell.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=0.03, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def make_scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)


def user_scaler(cell: Cell) -> torch.amp.GradScaler | None:
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE) if cell.precision == "fp16_user" else None


def config_fields(cell: Cell) -> dict:
    """The GradientAccumulationConfig fields of the cell (also the guides' config takes them)."""
    mixed = {"fp32": "no", "bf16": "bf16"}.get(cell.precision, "fp16")
    fields = dict(accumulation_steps=WINDOW, max_grad_norm=CLIP, mixed_precision=mixed, init_scale=INIT_SCALE)
    fields.update(gradient_accumulation_fusion=cell.path == "fusion", grad_views=cell.path == "views")
    if cell.parallel.startswith("ddp_"):
        fields["ddp_reduce"] = cell.parallel.removeprefix("ddp_")
    if cell.parallel in ("fsdp_window", "fsdp_micro"):
        fields["fsdp_reduce"] = "window" if cell.parallel == "fsdp_window" else "micro_step"
    return fields


def autocast(cell: Cell) -> contextlib.AbstractContextManager:
    if not low_precision(cell):
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16 if cell.precision == "bf16" else torch.float16)


def mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).to(y.dtype), y)


def chunk_rows(cell: Cell, micro: int) -> list[int]:
    """The rows of each piece micro-batch `micro` runs in: the adaptive path's chunks of CHUNK rows; after its
    injected OOM (at forward call EVENT_AT, micro-batch 0's second chunk) every later chunk has CHUNK // 2 rows
    (the size it keeps). An OOM in forward splits only the failed chunk, so micro-batch 0 keeps its first chunk;
    one in backward loses the window's sums (the first chunk's among them), so micro-batch 0 runs again from its
    first row in halves (window_replay.py)."""
    if cell.path != "adaptive":
        return [ROWS]
    if cell.event not in ("oom_forward", "oom_backward"):
        return [CHUNK] * (ROWS // CHUNK)
    half = CHUNK // 2
    if micro == 0 and cell.event == "oom_forward":
        return [CHUNK] + [half] * ((ROWS - CHUNK) // half)
    return [half] * (ROWS // half)


class _Fp32WeightGrad(torch.autograd.Function):
    """An autocast Linear whose weight and bias gradients are formed in fp32 from the 16-bit operands, as
    the fused Linears form them in their fp32 buffers (docs/linear-fusion.md); the input gradient stays 16-bit."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        dtype = torch.get_autocast_dtype("cpu")
        x16, w16 = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(x16, w16)
        return torch.nn.functional.linear(x16, w16, bias.to(dtype))

    @staticmethod
    def backward(ctx, grad):
        x16, w16 = ctx.saved_tensors
        grad_x = grad.to(w16.dtype) @ w16 if ctx.needs_input_grad[0] else None
        return grad_x, grad.float().t() @ x16.float(), grad.float().sum(0)


def _fp32_weight_grads(model: torch.nn.Sequential) -> None:
    for linear in (m for m in model if isinstance(m, torch.nn.Linear)):
        linear.forward = lambda x, lin=linear: _Fp32WeightGrad.apply(x, lin.weight, lin.bias)


def reference(cell: Cell, world: int) -> list[torch.Tensor]:
    """The plain loop (module docstring): the parameters it ends with."""
    model = make_model(cell._replace(event="none"))
    # FSDP2's DTensor params are left to the hooks path by the fusion (docs/linear-fusion.md): 16-bit weight grads
    if cell.path == "fusion" and low_precision(cell) and cell.parallel not in FSDP_MODES:
        _fp32_weight_grads(model)
    opt = make_optimizer(cell, reference_params(cell, model))
    sched = make_scheduler(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE) if cell.precision.startswith("fp16") else None
    batches = samples(cell, world)
    for start in range(0, len(batches), WINDOW):
        window = batches[start : start + WINDOW]
        opt.zero_grad(set_to_none=True)
        for i, batch in enumerate(window, start):
            for rank in range(world):
                x, y = shard(batch, rank)
                for part in zip(x.split(chunk_rows(cell, i)), y.split(chunk_rows(cell, i)), strict=True):
                    with autocast(cell):
                        loss = mse(model, part) * (len(part[0]) / ROWS) / (len(window) * world)
                    (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        sched.step()
    return trained(model, opt)


def trained(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What a run ends with: every parameter, then each parameter's optimizer state (momenta; not the step
    count), as full tensors. The state catches what a sign-based update (Lion) hides in the parameters."""
    from torch.distributed.tensor import DTensor

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    opt = getattr(opt, "optimizer", opt)  # Accelerate's AcceleratedOptimizer holds the optimizer
    # .get, not opt.state[p]: the state is a defaultdict, and the empty entries indexing adds to a fresh optimizer
    # make torch's get_state_dict take its state as initialised, so a DCP load after a snapshot restored none of it
    state = [opt.state.get(p, {}) for p in model.parameters()]
    moments = [full(s[k]) for s in state for k in sorted(s) if k != "step" and isinstance(s[k], torch.Tensor)]
    return [full(p) for p in model.parameters()] + moments
