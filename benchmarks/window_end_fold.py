"""The window end with the norm folded into the last fold (issue 31) against today's, side by side in one run.

Both contenders are GradientAccumulators over the workload's fp32 params (fp16 loss scaling, L2 clipping,
torch AdamW taken as the fused step), whose buffers hold the first micro-steps' sums. The timed call
is what the window's last micro-step adds to the window, in two parts: the last fold (every param's
fp32 gradient folded into its view, one call per param: the hooks' default bucket) and the window
close (norm, multiplier, fused step, scale update, release).

* today (norm pass): the last fold is accumulate_, the close reads every buffer again in a read-only
  norm pass (what main runs: WindowSums.fold_norm_type None, the path every flushed window takes);
* folded norm: the last fold is accumulate_final_, adding each view's sum of squares as it writes it;
  the close takes sqrt(sum) x inv_scale and reads no buffer before the step.

Besides the medians of --repeats interleaved rounds (the machine may be shared: quote its load), the bytes
are counted, deterministically, by wrapping the ops the buffers call (accumulate_, accumulate_final_:
read buffer and grad, write buffer; global_norm: read): per param, against the byte model (fp32 grads and
buffers: fold 4 + 4 + 4 = 12, norm pass 4, the AdamW step 28, counted by the model alone for both).
accumulate_final_'s CPU kernel reads each 64 Ki-element chunk a second time for its statistics while
the chunk is in cache; the count (and the model) are memory traffic, so that read is not in it.

--fused-linear: the Linear layers' weights and biases (every 2-D tensor but the two embeddings, and the
1-D tensor after each) are written as gradient_accumulation_fusion's GEMM writes them
(WindowSums.write_directly, then an in-place add: 12 B/element, counted by the model), in both contenders.
The folded norm then still takes a norm pass over those views alone (fold_norm.py: the GEMM's write
gathers no partial); the question is whether that part costs less than today's full pass.

    PYTHONPATH=. python benchmarks/window_end_fold.py --workload gpt2-small --scale 0.25 --threads 1
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable

import torch

import gradacc_ext.ops
from gradacc_ext.accumulate.accumulator import GradientAccumulator
from gradacc_ext.accumulate.config import GradientAccumulationConfig
from gradacc_ext.benchmarking.workloads import WORKLOADS, make_workload

LR, MAX_NORM, LOSS_SCALE, STEPS = 1e-4, 1.0, 1024.0, 4
STEP_BYTES = 28  # AdamW: reads param, grad, exp_avg, exp_avg_sq (16), writes param, exp_avg, exp_avg_sq (12)


class ByteCount:
    """Bytes the buffers' op calls move (reads + writes), while installed."""

    def __init__(self) -> None:
        self.bytes = 0
        self._saved = {name: getattr(gradacc_ext.ops, name) for name in ("accumulate_", "accumulate_final_")}
        self._saved["global_norm"] = gradacc_ext.ops.global_norm

    def __enter__(self) -> ByteCount:
        def size(ts) -> int:
            return sum(t.numel() * t.element_size() for t in ts)

        def fold(name: str) -> Callable:
            def run(bufs, grads, *args, **kwargs):
                self.bytes += 2 * size(bufs) + size(grads)
                return self._saved[name](bufs, grads, *args, **kwargs)

            return run

        def norm(tensors, *args, **kwargs):
            self.bytes += size(tensors)
            return self._saved["global_norm"](tensors, *args, **kwargs)

        gradacc_ext.ops.accumulate_ = fold("accumulate_")
        gradacc_ext.ops.accumulate_final_ = fold("accumulate_final_")
        gradacc_ext.ops.global_norm = norm
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            setattr(gradacc_ext.ops, name, fn)


def fused_linear_views(shapes) -> set[int]:
    """The GPT-shaped sets' Linear weights and biases: every 2-D tensor but the embeddings (the first two), and
    the 1-D tensor right after each (its bias; LayerNorm pairs follow 1-D tensors)."""
    weights = {i for i, s in enumerate(shapes) if len(s) == 2 and i >= 2}
    return weights | {i + 1 for i in weights if i + 1 < len(shapes) and len(shapes[i + 1]) == 1}


def make_window_end(
    shapes, folded: bool, fused: set[int]
) -> tuple[Callable[[], tuple[float, float]], int, torch.Tensor]:
    """An accumulator whose window lacks its last micro-step; returns a function timing that micro-step's fold and
    the window close (seconds), the param count and the window end's norm tensor (updated by each close).
    `fused`: the views the fused Linear's GEMM writes in the last micro-step (no fold, no partial)."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    config = GradientAccumulationConfig(
        accumulation_steps=STEPS, mixed_precision="fp16", init_scale=LOSS_SCALE, max_grad_norm=MAX_NORM,
        fused_step=True, growth_interval=10**6, grad_norm_history=0,
    )  # fmt: skip
    acc = GradientAccumulator(params, torch.optim.AdamW(params, lr=LR), config)
    sums, window = acc._sums, acc._window
    if not folded:
        sums.fold_norm_type = None  # today's window end: the last fold does not gather the norm
    acc._buffers._ensure()
    start = {d: torch.randn(f.shape, generator=g) * LOSS_SCALE for d, f in acc._buffers.flats.items()}
    last = [torch.randn(s, generator=g) * LOSS_SCALE for s in shapes]

    def window_end() -> tuple[float, float]:
        for d, f in acc._buffers.flats.items():
            f.copy_(start[d])
        sums.restore([True] * len(params))
        for _ in range(STEPS - 1):
            window.commit(False, 1.0, completes_micro_batch=True)
        t0 = time.perf_counter()
        sums.begin(last=True)
        for i in reversed(range(len(params))):  # backward's order, one fold per param (bucket_size_bytes=1)
            if i in fused:  # the GEMM's beta=1 write: view = view + grad, in place
                view, beta = sums.write_directly(i)
                view.add_(last[i]) if beta else view.copy_(last[i])
            else:
                sums.add([i], [last[i]], 1.0)
        sums.commit()
        window.commit(False, 1.0, completes_micro_batch=True)
        t1 = time.perf_counter()
        acc._end.close(window)
        acc.synchronize()  # the deferred outcome's host read belongs to this window's cost
        return t1 - t0, time.perf_counter() - t1

    return window_end, sum(p.numel() for p in params), acc._end.norm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=[k for k in WORKLOADS if k != "huge"], default="gpt2-small")
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fused-linear", action="store_true", help="the Linear views are written by the GEMM")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    workload = make_workload(args.workload, args.scale)
    load = os.getloadavg()[0]
    fused = fused_linear_views(workload.shapes) if args.fused_linear else set()
    share = sum(math.prod(workload.shapes[i]) for i in fused) / sum(math.prod(s) for s in workload.shapes)
    model = {"today (norm pass)": 12 + 4 + STEP_BYTES, "folded norm": 12 + 4 * share + STEP_BYTES}
    print(f"{workload.name} @{args.scale}: {workload.summary()}; {args.threads} thread(s); load {load:.1f}")
    if fused:
        print(f"fused Linear views: {len(fused)} tensors, {share:.1%} of the elements (GEMM-written, 12 B/element)")
    fns, numel, per_param, norms = {}, 0, {}, {}
    for name in model:
        fn, numel, norms[name] = make_window_end(workload.shapes, name == "folded norm", fused)
        fn()  # warm-up: optimizer state, first touch
        with ByteCount() as count:
            fn()
        fns[name], per_param[name] = fn, count.bytes / numel
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for r in range(args.repeats):  # interleaved rounds, the order alternating: load changes hit both alike
        for name in list(fns) if r % 2 == 0 else reversed(list(fns)):
            times[name].append(fns[name]())
    print("| contender | last fold ms | close ms | fold + close ms | counted B/param (+28 step) | model B/param |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, runs in times.items():
        fold, close = (1e3 * statistics.median(part) for part in zip(*runs, strict=True))
        both = 1e3 * statistics.median(a + b for a, b in runs)
        counted = per_param[name] + STEP_BYTES + 12 * share  # + the GEMM's writes, by the model
        print(f"| {name} | {fold:.2f} | {close:.2f} | {both:.2f} | {counted:.2f} | {model[name]:.2f} |")
    today, folded = (norms[name].item() for name in model)
    if abs(folded - today) > 1e-5 * today:  # the same window from the same state: the same norm
        raise SystemExit(f"the folded norm {folded} differs from today's {today}")
    print(f"norm (unscaled, both) {today:.6g} / {folded:.6g}; load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
