"""Op level: the last fold, unscale, inf check, clip and an AdamW step, side by side in one run (issue 10).

GradientAccumulator's window end runs the same passes spread over backward: there the last micro-step's
buckets are folded with accumulate_final_ as autograd produces them, then one fused step;
benchmarks/accumulator_tail.py times that. Here one accumulate_final_ call does the whole last fold.

Every contender starts from the same state: fp32 params whose .grad are fp32 accumulation buffers,
and this window's last bf16 micro-step grads (loss-scaled). It must add them, unscale, check for
inf, clip the global L2 norm and take one AdamW step:

* gradacc accumulate_final_ + adamw_step_: accumulate_final_ (add + inf + sum of squares, one pass; the sums
  stay scaled), then adamw_step_ with inv_scale x the clip coefficient as grad_mult (one pass): no unscale
  pass, no clip pass;
* gradacc accumulate_final_ + clip + torch fused AdamW: accumulate_final_, one unscale_ pass by inv_scale x the
  clip coefficient, torch AdamW(fused=True);
* torch eager: _foreach_add_, GradScaler's unscale kernel, clip_grad_norm_(foreach), AdamW(foreach);
* torch fused AdamW + foreach clip: the same tail, then AdamW(fused=True);
* torch.compile (eager tail + step): the eager contender's whole body under torch.compile (inductor).

Columns: median ms of --repeats interleaved calls; speed-up over torch eager; B/param that contender's
passes move (step_probes.py; inductor's fusion is its own, so none for compile); GB/s on the 38 B/param
floor every contender must move (grad read 2, buffer read+write 8, step reads param, buffer, exp_avg,
exp_avg_sq 16, writes 12) and "% copy": that GB/s over the harness's roofline (gradacc_ext.benchmarking's
Roofline, as in `gradacc bench`: the faster of copy_ and in-place add_ streams, sampled at the start and
after every interleaved round); peak MiB one warm step allocates on top of the state (allocator-level:
torch.profiler memory events on CPU, max_memory_allocated on CUDA). Figures depend on the machine (say
which when you quote). The first (compiling) call of torch.compile is timed apart.

On CUDA (--device cuda) each call is timed by CUDA events recorded around it on an idle stream (a
synchronize before the start event), so a time is the step's device time including any launch gaps, and
the issue-10 GPU targets are printed (and written with --json): the fused step >= 1.5x torch fused AdamW +
foreach clip, and >= 85% of the roofline.

    PYTHONPATH=. python benchmarks/fused_step.py --workload gpt2-small --scale 0.25 --threads 1
    PYTHONPATH=. python benchmarks/fused_step.py --device cuda --workload gpt2-small --scale 1 --no-compile
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from fused_step_targets import gpu_targets, write_json
from step_probes import BYTES_PER_PARAM, FLOOR_BYTES_PER_PARAM, peak_step_bytes

from gradacc_ext import ops
from gradacc_ext.benchmarking.report import OVER_ROOFLINE
from gradacc_ext.benchmarking.timing import Roofline, rotation_bytes
from gradacc_ext.benchmarking.workloads import WORKLOADS, make_workload
from gradacc_ext.ops.reference import clip_coefficient

LR, MAX_NORM, LOSS_SCALE = 1e-4, 1.0, 1024.0


class State:
    def __init__(self, shapes, seed: int, device: torch.device) -> None:
        # drawn on the device itself (a full-size model's state from the CPU took seconds per contender);
        # the same seed gives every contender the same state
        g = torch.Generator(device).manual_seed(seed)
        self.params = [torch.nn.Parameter(torch.randn(s, generator=g, device=device)) for s in shapes]
        for p in self.params:
            p.grad = torch.randn(p.shape, generator=g, device=device) * LOSS_SCALE
        self.grads = [(torch.randn(p.shape, generator=g, device=device) * LOSS_SCALE).bfloat16() for p in self.params]
        self.inv_scale = torch.full((), 1 / LOSS_SCALE, device=device)
        self.found_inf = torch.zeros((), device=device)
        self.norm = torch.zeros((), device=device)
        self.bufs = [p.grad for p in self.params]


def last_fold(s: State) -> torch.Tensor:
    """accumulate_final_ from a zeroed partial (the sums stay scaled); returns inv_scale x the clip coefficient."""
    s.norm.zero_()
    ops.accumulate_final_(s.bufs, s.grads, s.found_inf, s.norm)
    norm = s.norm.sqrt() * s.inv_scale  # the norm of the unscaled sums
    return s.inv_scale * clip_coefficient(norm, MAX_NORM, ops.DEFAULT_EPS)


def gradacc_fused(s: State) -> Callable[[], None]:
    exp_avgs = [torch.zeros_like(p) for p in s.params]
    exp_avg_sqs = [torch.zeros_like(p) for p in s.params]
    step = [torch.zeros((), device=s.norm.device)]  # one count shared by the list

    def run() -> None:
        ops.adamw_step_(
            s.params, s.bufs, exp_avgs, exp_avg_sqs, step, lr=LR, grad_mult=last_fold(s), found_inf=s.found_inf
        )

    return run


def gradacc_tail_torch_fused(s: State) -> Callable[[], None]:
    opt = torch.optim.AdamW(s.params, lr=LR, fused=True)

    def run() -> None:
        ops.unscale_(s.bufs, last_fold(s).reshape(()), s.found_inf)  # unscale and clip in one pass
        opt.step()

    return run


def torch_tail(opt: torch.optim.Optimizer, s: State, compiled: bool = False) -> Callable[[], None]:
    def run() -> None:
        torch._foreach_add_(s.bufs, s.grads)
        torch._amp_foreach_non_finite_check_and_unscale_(s.bufs, s.found_inf, s.inv_scale)
        torch.nn.utils.clip_grad_norm_(s.params, MAX_NORM, foreach=True)
        opt.step()

    return torch.compile(run) if compiled else run


CONTENDERS = {
    "gradacc accumulate_final_ + adamw_step_": gradacc_fused,
    "gradacc accumulate_final_ + clip + torch fused AdamW": gradacc_tail_torch_fused,
    "torch eager (foreach)": lambda s: torch_tail(torch.optim.AdamW(s.params, lr=LR, foreach=True), s),
    "torch fused AdamW + foreach clip": lambda s: torch_tail(torch.optim.AdamW(s.params, lr=LR, fused=True), s),
    "torch.compile (eager tail + step)": lambda s: torch_tail(
        torch.optim.AdamW(s.params, lr=LR, foreach=True), s, compiled=True
    ),
}
COMPILED = "torch.compile (eager tail + step)"


def _times(fn: Callable[[], object], repeats: int, device: torch.device, warm_up: bool = True) -> list[float]:
    """Seconds per call: wall clock on the CPU; on CUDA, events around the call on an idle device (the
    launches are asynchronous: a host clock would time the launches, not the kernels)."""
    if warm_up:
        fn()  # state allocation, first touch
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
            continue
        start_s = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start_s)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--workload", choices=[k for k in WORKLOADS if k != "huge"], default="gpt2-small")
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile contender")
    parser.add_argument(
        "--copy-mib",
        type=int,
        help="size the roofline as compare.py's --copy-mib does (two fp32 streams of a quarter of it each); "
        "default: the harness's rotation_bytes, as gradacc bench",
    )
    parser.add_argument("--out", type=Path, help="also write the table (markdown) to this file")
    parser.add_argument("--json", type=Path, help="also write the rows and the issue-10 GPU targets (JSON) here")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    workload = make_workload(args.workload, args.scale)
    numel = workload.numel
    where = f"{args.threads} thread(s)" if device.type == "cpu" else torch.cuda.get_device_name(device)
    lines = [f"{workload.name}: {workload.summary()}; {where}; torch {torch.__version__}", ""]
    print(lines[0])
    roofline = Roofline(device, args.copy_mib << 20 if args.copy_mib else rotation_bytes(device), args.threads)
    roofline.sample()
    contenders = {k: v for k, v in CONTENDERS.items() if not (args.no_compile and k == COMPILED)}
    fns, first_steps, first_calls = {}, {}, {}
    with torch.no_grad():
        for name, build in contenders.items():
            state = State(workload.shapes, seed=0, device=device)
            fns[name] = build(state)
            # the first step from the common state, then a second one (a compiled fn may recompile
            # once its optimizer state exists): the warm-up. Only the first is compared: after it the states
            # differ by design (gradacc's sums stay scaled, the torch tails unscale them in place).
            first_calls[name] = [1e3 * t for t in _times(fns[name], 1, device, warm_up=False)]
            # kept in host memory: on a GPU, a copy of every contender's params would crowd out the states
            first_steps[name] = torch.cat([p.reshape(-1) for p in state.params]).cpu()
            first_calls[name] += [1e3 * t for t in _times(fns[name], 1, device, warm_up=False)]
        # interleaved rounds: on a shared machine, load changes hit every contender alike
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():
                times[name] += _times(fn, 1, device, warm_up=False)
            roofline.sample()  # after every round, as the harness does after every cell: the load changes
        peaks = {name: peak_step_bytes(fn, device) for name, fn in fns.items()}
    rows = [(name, 1e3 * statistics.median(t)) for name, t in times.items()]
    eager = dict(rows)["torch eager (foreach)"]
    for name, params in first_steps.items():  # every contender computes the same step
        err = float((params - first_steps["torch eager (foreach)"]).abs().max())
        if err > 1e-5:
            raise SystemExit(f"{name}: its first step differs from torch eager's by {err:.3g}")
    lines += [
        "| contender | ms | vs eager | B/param moved | GB/s (38 B/param) | % copy | peak MiB | peak B/param |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    pcts = {}
    for name, ms in rows:
        moved = BYTES_PER_PARAM[name]
        gbps = FLOOR_BYTES_PER_PARAM * numel / ms / 1e6
        pct = pcts[name] = roofline.percent(gbps)
        lines.append(
            f"| {name} | {ms:.1f} | {eager / ms:.2f}x | {moved if moved is not None else '—'} | {gbps:.2f} | "
            f"{OVER_ROOFLINE if pct is None else f'{pct:.0f}%'} | {peaks[name] / 2**20:.1f} | "
            f"{peaks[name] / numel:.2f} |"
        )
    step_mib, streams_mib = FLOOR_BYTES_PER_PARAM * numel / 2**20, 4 * roofline.numel / 2**20
    # the harness's rule for its rotated input sets: below rotation_bytes, part of a call can run from cache
    from_cache = step_mib < rotation_bytes(device) / 2**20
    lines += [
        "",
        f"Roofline: {roofline.gbps:.2f} GB/s, the fastest call of two fp32 streams over {streams_mib:.0f} MiB "
        f"(copy_ 8 B/element, in-place add_ 12 B) in {len(roofline.samples)} samples. A step moves at least "
        f"{step_mib:.0f} MiB" + (", too few to rule out the cache: % copy is an upper bound." if from_cache else "."),
        "",
    ]
    lines += [f"First two calls (ms), {name}: {a:.0f}, {b:.0f}" for name, (a, b) in first_calls.items()]
    targets = gpu_targets(dict(rows), pcts) if device.type == "cuda" else []
    if targets:
        lines += ["", "Issue 10 GPU targets (this run):"]
        lines += [f"- {t['target']}: {t['measured_text']} (need {t['required_text']}): {t['status']}" for t in targets]
    print("\n".join(lines[1:]))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    if args.json:
        write_json(args.json, lines[0], dict(rows), pcts, peaks, roofline.gbps, targets, FLOOR_BYTES_PER_PARAM * numel)


if __name__ == "__main__":
    main()
