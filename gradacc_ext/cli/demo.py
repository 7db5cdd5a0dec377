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
import statistics
import sys
from typing import TextIO

import torch
from torch import nn

from ..ops import resolve_backend
from .demo_config import LOSS_NORMS, MAX_LEN, MIN_LEN, DemoConfig
from .demo_data import TaskConfig, make_batch
from .demo_model import ModelConfig, TinyCausalLM
from .demo_plot import write_loss_png
from .demo_train import CheckResult, TrainResult, equivalence_check, time_backends, train

__all__ = ["LOSS_NORMS", "MAX_LEN", "MIN_LEN", "DemoConfig", "run"]

BF16_CPU_HINT = (
    "note: bf16 autocast on a CPU is several times slower than float32 (CPUs without bf16 matrix units convert "
    "around every op); --amp no is the fast choice on a CPU, bf16 pays off on a GPU"
)


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
    if cfg.amp == "bf16" and device.type == "cpu":
        lines.append(BF16_CPU_HINT)  # once, before the slow run starts, not per step
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
