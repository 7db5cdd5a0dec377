"""`gradacc demo`: train a tiny causal LM with GradientAccumulator, then prove the accumulation exact.

The run, in order:
1. trains TinyCausalLM on the embedded task (gradacc_ext.demo_data) for
   `steps` optimizer steps of `grad_accum_steps` micro-batches each, with a
   progress bar, through GradientAccumulator (token-sum losses normalised by
   the token count of the whole window);
2. times optimizer steps on the same batches with backend="auto" (the
   compiled kernels where built) against backend="torch" (pure PyTorch),
   interleaved step by step so machine noise hits both alike;
3. equivalence check: a copy of the initial model trained for a few steps
   with accumulated micro-batches against one trained on the same samples as
   one full batch; parameters must agree within a float32 tolerance;
4. writes the loss curve as a PNG.
"""

from __future__ import annotations

import copy
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch
from torch import nn

from ..accumulate.accumulator import GradientAccumulator
from ..accumulate.config import GradientAccumulationConfig
from ..ops import resolve_backend
from .demo_data import Batch, TaskConfig, make_batch
from .demo_model import ModelConfig, TinyCausalLM, token_loss_sum
from .demo_plot import write_loss_png
from .progress import Progress

LOSS_NORMS = ("tokens", "mean-of-means")
CHECK_LR = 0.1  # SGD in the check: any error in the gradient's scale or direction moves the parameters
CHECK_RTOL, CHECK_ATOL = 2e-6, 1e-7  # float32 summation-order noise is ~1e-7 of the parameters


@dataclass(frozen=True)
class DemoConfig:
    """Everything `gradacc demo` takes; the CLI checks ranges before building one."""

    batch_size: int = 8  # micro-batch, in sequences
    grad_accum_steps: int = 4
    steps: int = 1000  # optimizer steps: about a minute on 2 CPU cores
    lr: float = 1e-2
    amp: str = "no"
    compile: bool = False
    max_grad_norm: float | None = 1.0
    seed: int = 0
    device: str = "cpu"
    out: Path | None = Path("gradacc_demo_loss.png")
    backend: str = "auto"
    # "mean-of-means" averages the micro-batches' own token means: the classic
    # bug with padded, variable-length batches; the equivalence check catches it.
    loss_norm: str = "tokens"
    d_model: int = 64
    n_layers: int = 2
    max_len: int = 48
    timing_steps: int = 10
    check_steps: int = 3
    # One intra-op thread by default: the demo's tensors are too small to gain from more,
    # and on a busy machine spinning worker threads make every step many times slower.
    threads: int = 1

    @property
    def effective_batch(self) -> int:
        return self.batch_size * self.grad_accum_steps


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


def train(model: nn.Module, cfg: DemoConfig, device: torch.device, batches: list[Batch], stream: TextIO) -> TrainResult:
    optimizer = _optimizer(model, cfg.lr, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(cfg.steps))
    acc = GradientAccumulator(
        model, optimizer, accumulator_config(cfg, cfg.backend, amp=cfg.amp, history=cfg.steps), scheduler
    )
    forward = _forward(model, cfg)
    progress = Progress(cfg.steps, stream=stream)
    losses: list[torch.Tensor] = []
    start = time.perf_counter()
    for step, batch in enumerate(batches, 1):
        losses.append(run_window(acc, forward, batch, cfg))
        # Reading the loss syncs; the progress bar only needs it when it prints.
        progress.update(step, lambda: f"loss {losses[-1].item():.3f}  lr {scheduler.get_last_lr()[0]:.2e}")
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


def _stats_line(values: list[float]) -> str:
    if not values:
        return "no finite values (every step overflowed and was skipped)"
    return f"min {min(values):.4f}  mean {statistics.fmean(values):.4f}  max {max(values):.4f}  ({len(values)} steps)"


def _print_header(cfg: DemoConfig, task: TaskConfig, model: nn.Module, device: torch.device, out: TextIO) -> None:
    chosen, reason = resolve_backend(device, cfg.backend)
    params = sum(p.numel() for p in model.parameters())
    clip = "off" if cfg.max_grad_norm is None else f"{cfg.max_grad_norm:g}"
    lines = [
        f"gradacc demo: causal LM, {cfg.n_layers} layers x d_model {cfg.d_model} ({params:,} parameters) on {device}",
        f"task: modular walks (stride 1-{task.max_stride}), vocab {task.vocab_size}, lengths {task.min_len}-"
        f"{task.max_len} right-padded, {task.noise:.0%} noise; loss normalisation: {cfg.loss_norm}",
        f"amp {cfg.amp}, compile {'on' if cfg.compile else 'off'}, max grad norm {clip}, "
        f"{cfg.threads} CPU thread{'s' if cfg.threads > 1 else ''}, "
        f"backend {cfg.backend} -> {chosen} ({reason})",
        f"micro-batch {cfg.batch_size} x steps {cfg.grad_accum_steps} x world 1 = "
        f"effective batch {cfg.effective_batch}",
    ]
    print("\n".join(lines), file=out)


def _print_report(
    cfg: DemoConfig,
    device: torch.device,
    result: TrainResult,
    timing: dict[str, float],
    timed_steps: int,
    check: CheckResult,
    check_steps: int,
    out: TextIO,
) -> None:
    tail = result.losses[-min(10, len(result.losses)) :]
    auto, _ = resolve_backend(device, "auto")
    verdict = "MATCH" if check.match else "MISMATCH"
    lines = [
        f"final loss: {result.losses[-1]:.4f} (mean of the last {len(tail)} steps {statistics.fmean(tail):.4f}; "
        f"first step {result.losses[0]:.4f})",
        f"optimizer steps: {result.optimizer_steps}, skipped (inf/NaN): {result.skipped_steps}, "
        f"micro-batches: {cfg.steps * cfg.grad_accum_steps}, training time {result.seconds:.1f} s",
        f"grad norm (pre-clip): {_stats_line(result.grad_norms)}",
        f"time per optimizer step (median of {timed_steps}): backend=auto -> {auto} "
        f"{timing['auto'] * 1e3:.2f} ms, backend=torch (pure PyTorch) {timing['torch'] * 1e3:.2f} ms "
        f"(torch/auto {timing['torch'] / timing['auto']:.2f}x)",
        f"equivalence check ({check_steps} steps of {cfg.grad_accum_steps} accumulated micro-batches vs one batch of "
        f"{cfg.effective_batch}; float32, SGD): {verdict}, max |param diff| {check.max_diff:.3e} "
        f"(tolerance {check.tolerance:.3e})",
    ]
    if not check.match:
        lines.append(
            "  the accumulated gradient is not the full-batch gradient: with --loss-norm mean-of-means, short "
            "micro-batches weigh more than their tokens"
            if cfg.loss_norm == "mean-of-means"
            else "  the accumulated gradient is not the full-batch gradient"
        )
    print("\n".join(lines), file=out)


def run(cfg: DemoConfig, stream: TextIO | None = None) -> int:
    """Runs the demo and prints its report; returns the exit code (1 on a failed equivalence check)."""
    out = stream if stream is not None else sys.stdout
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, out)
    finally:
        torch.set_num_threads(previous_threads)  # callers in the same process keep their setting


def _run(cfg: DemoConfig, out: TextIO) -> int:
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    task = TaskConfig(max_len=cfg.max_len)
    model = TinyCausalLM(
        ModelConfig(vocab_size=task.vocab_size, max_len=task.max_len, d_model=cfg.d_model, n_layers=cfg.n_layers)
    ).to(device)
    initial = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(cfg.seed)
    batches = [make_batch(task, cfg.effective_batch, generator) for _ in range(cfg.steps)]
    timed, checked = batches[: cfg.timing_steps], batches[: cfg.check_steps]

    _print_header(cfg, task, model, device, out)
    result = train(model, cfg, device, batches, out)
    timing = time_backends(initial, cfg, device, timed)
    check = equivalence_check(initial, cfg, device, checked)
    _print_report(cfg, device, result, timing, len(timed), check, len(checked), out)
    if cfg.out is not None:
        title = f"gradacc demo: {cfg.batch_size} x {cfg.grad_accum_steps} = {cfg.effective_batch}, amp {cfg.amp}"
        try:
            write_loss_png(cfg.out, result.losses, title)
            print(f"loss curve: {cfg.out}", file=out)
        except RuntimeError as exc:
            print(f"loss curve: skipped, {exc}", file=out)
    return 0 if check.match else 1
