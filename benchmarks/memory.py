"""Gradient memory of a window: plain loop vs gradacc (this tree) vs gradacc as of a baseline commit.

    python benchmarks/memory.py                          # CPU, scaled-down GPT-2-shaped model, 4 micro-steps
    python benchmarks/memory.py --baseline 5d7c6ab --layers 12 --width 768 --vocab 50257   # GPT-2 small itself

Each (case, implementation) runs in its own process. Memory: peak and end-of-window bytes above model +
optimizer state, per parameter. On CPU they come from the allocator itself (torch.profiler with
profile_memory: every CPU allocation and free, in order); on CUDA from torch.cuda.max_memory_allocated.
Peaks include activations, which are the same for every implementation. Time: mean micro-step and
window wall time over the timed windows, all implementations in the same run. The baseline
implementation is the tree at --baseline, exported with `git archive` and built with its own
extension (once per commit, under --baseline-cache), with this tree's memory probe.
Writes <date>_memory_<device>_<commit>.{json,md} under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from memory_probes import LiveBytes, OutsideBytes

ROOT = Path(__file__).resolve().parent.parent
CASES = {  # name: (param dtype, accum_dtype)
    "fp32": (torch.float32, torch.float32),
    "bf16+fp32 acc": (torch.bfloat16, torch.float32),
    "bf16+bf16 acc": (torch.bfloat16, None),
}
IMPLS = (
    "plain",
    "plain grad_dtype=fp32",
    "gradacc",
    "gradacc grad_views",
    "gradacc release_buffers",
    "gradacc baseline",
)


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.c_attn, self.c_proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.c_fc, self.mlp_proj = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.c_proj(a)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The device, torch threads, GPT shape and micro-batch flags that memory.py and state_memory.py share."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (per process)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--ctx", type=int, default=32)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=2)


class GPT(torch.nn.Module):
    """GPT-2's parameter layout (tied token embedding and head), any size."""

    def __init__(self, vocab: int, ctx: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, d), torch.nn.Embedding(ctx, d)
        self.h = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def worker(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    pdtype, accum = CASES[args.case]
    torch.manual_seed(0)
    model = GPT(args.vocab, args.ctx, args.width, args.layers, args.heads).to(device, pdtype)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(params, lr=1e-4, **fused)
    data = torch.randint(0, args.vocab, (64, args.micro_batch, args.ctx + 1), device=device)
    steps = 4

    def loss_of(i: int) -> torch.Tensor:
        batch = data[i % len(data)]
        return F.cross_entropy(model(batch[:, :-1]).float().flatten(0, 1), batch[:, 1:].flatten())

    bucket = None
    if args.impl.startswith("plain"):
        if "grad_dtype" in args.impl:
            for p in params:
                p.grad_dtype = torch.float32

        def micro(i: int) -> None:
            (loss_of(i) / steps).backward()
            if i % steps == steps - 1:
                grad_dtype = params[0].grad_dtype
                for p in params:  # optimizers need param-dtype grads: a transient cast, released with zero_grad
                    p.grad_dtype, p.grad = None, p.grad.to(p.dtype)
                opt.step()
                opt.zero_grad(set_to_none=True)
                for p in params:
                    p.grad_dtype = grad_dtype
    else:
        from gradacc_ext import GradientAccumulationConfig, GradientAccumulator

        # The library's default (1 byte: each gradient folded as it arrives) unless --bucket-bytes says otherwise.
        options = {"release_buffers": True} if "release" in args.impl else {}
        if "grad_views" in args.impl:
            options["grad_views"] = True
        if args.impl != "gradacc baseline":  # the baseline keeps its own default
            bucket = args.bucket_bytes or GradientAccumulationConfig.bucket_size_bytes
            options["bucket_size_bytes"] = bucket
        config = GradientAccumulationConfig(accumulation_steps=steps, accum_dtype=accum, **options)
        acc = GradientAccumulator(model, opt, config)

        def micro(i: int) -> None:
            acc.backward(loss_of(i))

    def window(start: int) -> list[float]:
        times = []
        for i in range(start, start + steps):
            t0 = time.perf_counter()
            micro(i)
            times.append(time.perf_counter() - t0)
        return times

    window(0)  # warm-up: optimizer state and (gradacc) buffers exist from here on
    held = _held(model, locals().get("acc"))
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    with LiveBytes(device) as mem:
        window(steps)
    with OutsideBytes(params, locals().get("acc")) as outside:
        for i in range(2 * steps, 3 * steps):
            outside.micro = i % steps
            micro(i)
    micro_times = [t for w in range(3, 3 + args.windows) for t in window(w * steps)]
    return {
        "case": args.case,
        "impl": args.impl,
        "params": n,
        "optimizer_state_bytes": state,
        # gradacc's persistent buffers were allocated in the warm-up window: count them in.
        "held_before": held,
        "bucket_bytes": bucket,
        "peak": mem.peak,
        "end": mem.end,
        "micro_step_s": sum(micro_times) / len(micro_times),
        "window_s": sum(micro_times) / args.windows,
        "outside_first": outside.most[0],
        "outside_later": max(outside.most[1:]),
    }


def _held(model: torch.nn.Module, acc: object) -> int:
    """Gradient bytes alive at the start of the measured window (between windows): .grad, buffers, cast copies."""
    held = [p.grad for p in model.parameters() if p.grad is not None]
    buffers = getattr(acc, "_buffers", None)
    held += list(getattr(buffers, "flats", {}).values())
    held += getattr(buffers, "_cast_views", None) or []  # the baseline's persistent param-dtype copies
    return sum(t.numel() * t.element_size() for t in held)


def export_baseline(ref: str, cache: Path, device: str) -> Path:
    """The tree at `ref`, exported with `git archive` and its extension built in place from its own sources (an
    older tree's Python calls its own ops' schemas, which this tree's _C no longer has). Built once per commit
    and device kind into `cache` (minutes on a small machine); the allocator probe is this tree's."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", ref], check=True, capture_output=True, text=True)
    into = cache / f"{sha.stdout.strip()}-{'cuda' if device.startswith('cuda') else 'cpu'}"
    if not any((into / "gradacc_ext").glob("_C*.so")):
        shutil.rmtree(into, ignore_errors=True)
        into.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
        env = {**os.environ, "GRADACC_NO_CUDA": "0" if device.startswith("cuda") else "1"}
        print(f"building the baseline {ref}'s extension in {into} ...", flush=True)
        build = [sys.executable, "setup.py", "build_ext", "--inplace"]
        out = subprocess.run(build, cwd=into, env=env, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"the baseline {ref} did not build:\n{out.stderr[-3000:]}")
    probe = Path("gradacc_ext", "benchmarking", "memory.py")
    shutil.copy(ROOT / probe, into / probe)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--bucket-bytes", type=int, help="default: the config's (1 byte)")
    parser.add_argument("--windows", type=int, default=2, help="timed windows per implementation")
    # 5d7c6ab: main just before issue 9 (gradients materialised in full, then folded; persistent cast copies).
    parser.add_argument("--baseline", default="5d7c6ab", help="git ref of the baseline implementation")
    parser.add_argument(
        "--baseline-cache",
        default=str(Path.home() / ".cache" / "gradacc_ext" / "baselines"),
        help="where baseline trees are exported and built, once per commit",
    )
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=IMPLS, help="implementations to run")
    parser.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(worker(args)))
        return
    rows = []
    wants_baseline = "gradacc baseline" in args.impls
    baseline = export_baseline(args.baseline, Path(args.baseline_cache), args.device) if wants_baseline else None
    for case in CASES:
        for impl in args.impls:
            if impl == "plain grad_dtype=fp32" and case != "bf16+fp32 acc":
                continue
            if impl == "gradacc grad_views" and case == "bf16+fp32 acc":
                continue  # grad and buffer dtypes differ: no view is ever attached, the same as gradacc
            path = str(baseline if impl == "gradacc baseline" else ROOT)
            env = {**os.environ, "PYTHONPATH": path}
            argv = sys.argv[1:] + ["--case", case, "--impl", impl]
            out = subprocess.run([sys.executable, __file__, *argv], env=env, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"{case} / {impl} failed:\n{out.stderr[-3000:]}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    write(rows, args)


def write(rows: list[dict], args: argparse.Namespace) -> None:
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=8", "HEAD"], capture_output=True, text=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    stem = ROOT / "benchmarks" / "results" / f"{stamp}_memory_{args.device}_{commit.stdout.strip()}"
    n = rows[0]["params"]
    bucket = max(r["bucket_bytes"] or 0 for r in rows)
    lines = [
        f"Gradient memory, {args.device}, torch {torch.__version__}, GPT-2-shaped model: {n:,} parameters "
        f"(width {args.width}, {args.layers} layers, vocab {args.vocab}, ctx {args.ctx}), micro-batch "
        f"{args.micro_batch}, 4 micro-steps, AdamW, bucket {bucket:,} bytes. "
        "B/param: bytes above model + optimizer state / parameters; peaks include activations (the same for "
        "every implementation). Times: mean of the timed windows (load average "
        f'{os.getloadavg()[0]:.1f} at the end). "gradacc baseline": the tree at {args.baseline}, built from its '
        "own sources.",
        "",
        "| case | implementation | held between windows B/param | peak in window B/param | "
        "grads outside buffers, micro-step 1 / 2-4, B/param | micro-step ms | window ms |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        held = r["held_before"]
        peak = held + r["peak"]
        lines.append(
            f"| {r['case']} | {r['impl']} | {held / n:.2f} | {peak / n:.2f} | {r['outside_first'] / n:.2f} / "
            f"{r['outside_later'] / n:.2f} | {r['micro_step_s'] * 1e3:.1f} | {r['window_s'] * 1e3:.1f} |"
        )
    stem.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {stem}.md and .json")


if __name__ == "__main__":
    main()
