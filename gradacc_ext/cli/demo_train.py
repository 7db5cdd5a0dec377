"""The demo's three runs on one model: training, the backend timing and the equivalence check."""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

import torch
from torch import nn
from tqdm import tqdm

from ..accumulate.accumulator import GradientAccumulator
from ..accumulate.config import GradientAccumulationConfig
from .demo_config import DemoConfig
from .demo_data import Batch
from .demo_model import token_loss_sum

CHECK_LR = 0.1  # SGD in the check: any error in the gradient's scale or direction moves the parameters
CHECK_RTOL, CHECK_ATOL = 2e-6, 1e-7  # float32 summation-order noise is ~1e-7 of the parameters


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    optimizer_steps: int = 0
    skipped_steps: int = 0
    grad_norms: list[float] = field(default_factory=list)
    seconds: float = 0.0


@dataclass(frozen=True)
class CheckResult:
    match: bool
    max_diff: float
    tolerance: float


def accumulator_config(cfg: DemoConfig, backend: str, *, amp: str, history: int) -> GradientAccumulationConfig:
    return GradientAccumulationConfig(
        accumulation_steps=cfg.grad_accum_steps,
        micro_batch_size=cfg.batch_size,
        max_grad_norm=cfg.max_grad_norm,
        mixed_precision=amp,
        loss_normalization="sum" if cfg.loss_norm == "tokens" else "mean",
        grad_norm_history=history,
        backend=backend,
    )


def run_window(
    acc: GradientAccumulator, forward: Callable[[torch.Tensor], torch.Tensor], batch: Batch, cfg: DemoConfig
) -> torch.Tensor:
    """One optimizer step: the batch in micro-batches through `acc`; returns the window's token-mean loss.

    The token counts come from the CPU copy of the batch, so no host sync is needed for them.
    """
    device = acc.device
    total = torch.zeros((), dtype=torch.float32, device=device)
    for micro in batch.split(cfg.batch_size):
        tokens = micro.num_tokens()
        on_device = micro.to(device)
        with acc.micro_step():
            loss_sum = token_loss_sum(forward, on_device)
            if cfg.loss_norm == "tokens":
                acc.backward(loss_sum, num_items=tokens)
            else:
                acc.backward(loss_sum / max(tokens, 1))
        total += loss_sum.detach()
    return total / max(batch.num_tokens(), 1)


def _optimizer(model: nn.Module, lr: float, device: torch.device) -> torch.optim.Optimizer:
    # fused=True: the accumulator hands found_inf to the kernel, so a step needs no host sync.
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, fused=device.type in ("cuda", "cpu"))


def _schedule(steps: int) -> Callable[[int], float]:
    """Linear warm-up over 10% of the steps, then cosine decay to 10% of the peak."""
    warmup = max(1, steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def _forward(model: nn.Module, cfg: DemoConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    return torch.compile(model) if cfg.compile else model


def progress_bar(total: int, stream: TextIO) -> tqdm:
    """A tqdm bar on `stream`: redrawn often on a terminal; in a log (CI, a pipe), where every redraw
    stays as text, drawn every few seconds in plain ASCII."""
    tty = bool(getattr(stream, "isatty", lambda: False)())
    return tqdm(total=total, file=stream, unit="step", mininterval=0.2 if tty else 5.0, ascii=not tty)


def train(model: nn.Module, cfg: DemoConfig, device: torch.device, batches: list[Batch], stream: TextIO) -> TrainResult:
    optimizer = _optimizer(model, cfg.lr, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(cfg.steps))
    acc = GradientAccumulator(
        model, optimizer, accumulator_config(cfg, cfg.backend, amp=cfg.amp, history=cfg.steps), scheduler
    )
    forward = _forward(model, cfg)
    losses: list[torch.Tensor] = []
    start = time.perf_counter()
    with progress_bar(cfg.steps, stream) as bar:
        for step, batch in enumerate(batches, 1):
            losses.append(run_window(acc, forward, batch, cfg))
            # Reading the loss syncs the device: only when the bar is about to draw (and on the last step).
            if step == cfg.steps or time.time() - bar.last_print_t >= bar.mininterval:
                bar.set_postfix_str(f"loss {losses[-1].item():.3f}  lr {scheduler.get_last_lr()[0]:.2e}", refresh=False)
            bar.update(1)
    acc.synchronize()
    seconds = time.perf_counter() - start
    norms = acc.grad_norm_history()
    return TrainResult(
        losses=torch.stack(losses).cpu().tolist(),
        optimizer_steps=acc.optimizer_steps,
        skipped_steps=acc.skipped_steps,
        grad_norms=norms[torch.isfinite(norms)].tolist(),
        seconds=seconds,
    )


def time_backends(model: nn.Module, cfg: DemoConfig, device: torch.device, batches: list[Batch]) -> dict[str, float]:
    """Median seconds per optimizer step for backend "auto" and "torch", interleaved step by step."""
    runs = {}
    for backend in ("auto", "torch"):
        copy_ = copy.deepcopy(model)
        acc = GradientAccumulator(
            copy_, _optimizer(copy_, cfg.lr, device), accumulator_config(cfg, backend, amp=cfg.amp, history=0)
        )
        runs[backend] = (acc, _forward(copy_, cfg), [])
    for i, batch in enumerate([batches[0], *batches]):  # the first round warms up (and compiles)
        for acc, forward, times in runs.values():
            _sync(device)
            start = time.perf_counter()
            run_window(acc, forward, batch, cfg)
            acc.synchronize()
            _sync(device)
            if i:
                times.append(time.perf_counter() - start)
    return {backend: statistics.median(times) for backend, (_, _, times) in runs.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def equivalence_check(model: nn.Module, cfg: DemoConfig, device: torch.device, batches: list[Batch]) -> CheckResult:
    """Accumulated micro-batches against one full batch of the same samples, in float32 without autocast.

    Both copies take SGD steps (clipped at max_grad_norm when set); the full-batch
    side is plain PyTorch: the token-mean loss of the whole batch, backward,
    clip_grad_norm_, step. Autocast is off because its rounding depends on the
    batch shape, which would blur the comparison.
    """
    accumulated, full = copy.deepcopy(model).float(), copy.deepcopy(model).float()
    acc = GradientAccumulator(
        accumulated,
        torch.optim.SGD(accumulated.parameters(), lr=CHECK_LR),
        accumulator_config(cfg, cfg.backend, amp="no", history=0),
    )
    full_optimizer = torch.optim.SGD(full.parameters(), lr=CHECK_LR)
    for batch in batches:
        run_window(acc, accumulated, batch, cfg)
        full_optimizer.zero_grad(set_to_none=True)
        on_device = batch.to(device)
        (token_loss_sum(full, on_device) / batch.num_tokens()).backward()
        if cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(full.parameters(), cfg.max_grad_norm)
        full_optimizer.step()
    acc.synchronize()
    pairs = [(a.detach(), b.detach()) for a, b in zip(accumulated.parameters(), full.parameters(), strict=True)]
    max_diff = max(float((a - b).abs().max()) for a, b in pairs)
    tolerance = CHECK_ATOL + CHECK_RTOL * max(float(b.abs().max()) for _, b in pairs)
    return CheckResult(match=max_diff <= tolerance, max_diff=max_diff, tolerance=tolerance)
