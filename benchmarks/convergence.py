"""Convergence of a small causal LM under each optimizer of benchmarks/optimizer_contenders.py (issue 30's quality).

    python benchmarks/convergence.py            # the default: small, a few minutes on a 2-core CPU
    python benchmarks/convergence.py --full     # the issue's scale: more steps, a wider and deeper model
    python benchmarks/convergence.py --steps 60 --seeds 0 --contenders "FusedAdamW fp32 states"

The demo's model (gradacc_ext/cli/demo_model.py: TinyCausalLM from a ModelConfig, nothing downloaded) learns
an order-2 Markov language (benchmarks/markov_corpus.py) through our GradientAccumulator (fp32 accumulation
buffers, `--accumulation` micro-batches a step), at a constant learning rate (torchao's optimizers refuse a
scheduler's float lr). Each (optimizer, seed) starts from the same weights and draws the same sequences as
every other optimizer with that seed. Every `--eval-every` steps the loss on a fixed held-out set (positions
that have their full two-token context) is recorded; the table gives its final value, mean over the seeds,
and the gaps issue 30's targets use: against FusedAdamW's fp32 states and against torchao's AdamW8bit. A
contender that cannot run here (not installed, no state_dtype yet) or fails is listed with the reason.

Writes <date>_convergence_<device>_<commit>.{json,md,png} under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from convergence_report import head_commit, write
from markov_corpus import MarkovCorpus
from optimizer_contenders import CONTENDERS, Contender

from gradacc_ext import GradientAccumulationConfig, GradientAccumulator
from gradacc_ext.cli.demo_model import ModelConfig, TinyCausalLM

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# With fp32 params the param mode does nothing: FusedAdamW's master row would repeat its fp32-states row.
DEFAULT_CONTENDERS = [name for name in CONTENDERS if name != "FusedAdamW master, fp32 states"]
FULL = {"steps": 1000, "d_model": 128, "layers": 4, "eval_every": 50}  # --full's sizes


def eval_loss(model: torch.nn.Module, tokens: torch.Tensor) -> float:
    """Mean next-token cross-entropy on tokens[:, 2:] (each target with its two-token context)."""
    with torch.no_grad():
        logits = model(tokens[:, :-1]).float()[:, 1:]
        return float(F.cross_entropy(logits.flatten(0, 1), tokens[:, 2:].flatten()))


def train(
    contender: Contender, seed: int, args: argparse.Namespace, corpus: MarkovCorpus, held_out: torch.Tensor
) -> dict:
    """One run: `args.steps` optimizer steps; the held-out loss curve and the mean training loss per step."""
    torch.manual_seed(seed)
    config = ModelConfig(args.vocab, args.seq_len, args.d_model, args.heads, args.layers)
    model = TinyCausalLM(config).to(DTYPES[args.param_dtype])
    optimizer = contender.build(list(model.parameters()), args.lr)
    acc = GradientAccumulator(model, optimizer, GradientAccumulationConfig(accumulation_steps=args.accumulation))
    data = torch.Generator().manual_seed(seed)
    curve, train_losses = [(0, eval_loss(model, held_out))], []
    start = time.perf_counter()
    with contender.stepping():
        for step in range(1, args.steps + 1):
            batch = corpus.sample(args.accumulation * args.micro_batch, args.seq_len + 1, data)
            losses = []
            for micro in batch.split(args.micro_batch):
                logits = model(micro[:, :-1]).float()
                loss = F.cross_entropy(logits.flatten(0, 1), micro[:, 1:].flatten())
                acc.backward(loss)
                losses.append(float(loss.detach()))
            train_losses.append(sum(losses) / len(losses))
            if step % args.eval_every == 0 or step == args.steps:
                curve.append((step, eval_loss(model, held_out)))
    if acc.optimizer_steps != args.steps or acc.skipped_steps:
        raise RuntimeError(f"{acc.optimizer_steps} optimizer steps ({acc.skipped_steps} skipped), not {args.steps}")
    return {"seed": seed, "curve": curve, "train": train_losses, "seconds": time.perf_counter() - start}


def run(names: list[str], args: argparse.Namespace) -> tuple[list[dict], float]:
    """Every contender over every seed; the rows and the corpus' loss floor on the held-out set."""
    corpus = MarkovCorpus(args.vocab)
    held_out = corpus.sample(args.eval_sequences, args.seq_len + 1, torch.Generator().manual_seed(10**6))
    rows = []
    for name in names:
        contender = CONTENDERS[name]
        row: dict = {"contender": name}
        why = contender.missing()
        if why is not None:
            row["skipped"] = why
        else:
            try:
                row["runs"] = [train(contender, seed, args, corpus, held_out) for seed in args.seeds]
            except Exception as error:  # a peer's CPU path may not work: the row says how it failed
                row["failed"] = f"{type(error).__name__}: {error}"
        rows.append(row)
        print({k: v for k, v in row.items() if k != "runs"}, [r["curve"][-1] for r in row.get("runs", [])], flush=True)
    return rows, corpus.floor(held_out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help=f"the full run: {FULL} unless given explicitly")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens the model reads per sequence")
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--param-dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--eval-every", type=int, default=25, help="optimizer steps between held-out losses")
    parser.add_argument("--eval-sequences", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--contenders", nargs="+", choices=list(CONTENDERS), default=DEFAULT_CONTENDERS)
    parser.add_argument("--out-dir", help="where the result files go (default: benchmarks/results/)")
    args = parser.parse_args(argv)
    if args.full:
        given = set(sys.argv[1:] if argv is None else argv)
        for key, value in FULL.items():
            if f"--{key.replace('_', '-')}" not in given:
                setattr(args, key, value)
    for key in ("steps", "accumulation", "micro_batch", "eval_every", "eval_sequences", "threads"):
        if getattr(args, key) < 1:
            raise SystemExit(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    commit = head_commit()
    rows, floor = run(args.contenders, args)
    write(rows, floor, args, commit)


if __name__ == "__main__":
    main()
