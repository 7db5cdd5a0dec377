"""Interleaved A/B of the hooks path and grad_views, in one process: window time, medians.

    python benchmarks/grad_views_ab.py [--windows 12] [--dtype float32|bfloat16]

benchmarks/memory.py runs each implementation in its own process, one after the other, so on a shared
machine a load change between processes shows up as a time difference. Here two copies of the same
GPT-2-shaped model (memory.py's, same default size and scaled bucket) run alternating windows, hooks then
views, and the median window time of each is printed with their ratio.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from memory import GPT, GPT2_SMALL_PARAMS

from gradacc_ext import GradientAccumulationConfig, GradientAccumulator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=12)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    vocab, ctx, steps = 4096, 32, 4
    base = GPT(vocab, ctx, 128, 4, 4).to(getattr(torch, args.dtype))
    n = sum(p.numel() for p in base.parameters())
    bucket = round(25 * 2**20 * n / GPT2_SMALL_PARAMS)
    data = torch.randint(0, vocab, (16, 2, ctx + 1))
    runs = {}
    for name in ("hooks", "grad_views"):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        config = GradientAccumulationConfig(
            accumulation_steps=steps, accum_dtype=None, bucket_size_bytes=bucket, grad_views=name == "grad_views"
        )
        runs[name] = (model, GradientAccumulator(model, opt, config), [])
    for w in range(args.windows + 2):
        for model, acc, times in runs.values():
            t0 = time.perf_counter()
            for i in range(steps):
                batch = data[(w * steps + i) % len(data)]
                acc.backward(F.cross_entropy(model(batch[:, :-1]).float().flatten(0, 1), batch[:, 1:].flatten()))
            if w >= 2:  # the first two windows warm up (optimizer state, buffers)
                times.append(time.perf_counter() - t0)
    med = {name: statistics.median(times) * 1e3 for name, (_, _, times) in runs.items()}
    print(
        f"{args.dtype}, {n:,} params, {args.windows} windows each, interleaved: hooks {med['hooks']:.1f} ms, "
        f"grad_views {med['grad_views']:.1f} ms per window (views / hooks = {med['grad_views'] / med['hooks']:.3f})"
    )


if __name__ == "__main__":
    main()
