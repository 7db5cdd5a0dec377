"""`gradacc demo`: its flags, their cross-checks, and the DemoConfig they build."""

from __future__ import annotations

import argparse
from pathlib import Path

from .args import DEVICES, check_output_file, float_above, int_at_least, resolve_device


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    from .demo import LOSS_NORMS, MAX_LEN, MIN_LEN, DemoConfig

    d = DemoConfig()
    p.add_argument(
        "--batch-size", type=int_at_least(1), metavar="N", default=d.batch_size, help="micro-batch size (sequences)"
    )
    p.add_argument(
        "--grad-accum-steps",
        type=int_at_least(1),
        metavar="N",
        default=d.grad_accum_steps,
        help="micro-batches per optimizer step",
    )
    p.add_argument("--steps", type=int_at_least(1), metavar="N", default=d.steps, help="optimizer steps")
    p.add_argument("--lr", type=float_above(0), metavar="X", default=d.lr, help="peak AdamW learning rate")
    p.add_argument("--amp", choices=("no", "fp16", "bf16"), default=d.amp, help="autocast precision")
    p.add_argument(
        "--use-amp", dest="amp", action="store_const", const="fp16", help="the guides' spelling of --amp fp16"
    )
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument(
        "--max-grad-norm",
        metavar="X",
        type=float_above(0, inclusive=True, note=" (0 disables clipping)"),
        default=d.max_grad_norm,
        help="clip the global grad norm to this; 0 disables",
    )
    p.add_argument("--seed", type=int_at_least(0), metavar="N", default=d.seed, help="seed of the model and the data")
    p.add_argument("--device", choices=DEVICES, default="auto", help="auto: cuda when available, else cpu")
    p.add_argument(
        "--backend",
        choices=("auto", "ext", "torch"),
        default=d.backend,
        help="ops backend for the training run (the timing compares auto with torch)",
    )
    p.add_argument("--out", type=Path, metavar="PNG", default=d.out, help="PNG path of the loss curve")
    p.add_argument("--no-plot", action="store_true", help="do not write the loss curve")
    p.add_argument(
        "--loss-norm",
        choices=LOSS_NORMS,
        default=d.loss_norm,
        help="tokens: token-sum losses over the window's token count (exact); mean-of-means: the "
        "common bug of averaging micro-batch means, which the equivalence check reports",
    )
    p.add_argument(
        "--d-model", type=int_at_least(4), metavar="N", default=d.d_model, help="model width (a multiple of 4)"
    )
    p.add_argument("--n-layers", type=int_at_least(1), metavar="N", default=d.n_layers, help="transformer blocks")
    p.add_argument(
        "--max-len",
        type=int_at_least(MIN_LEN, MAX_LEN),
        metavar="N",
        default=d.max_len,
        help="longest sequence (tokens)",
    )
    p.add_argument(
        "--timing-steps",
        type=int_at_least(1),
        metavar="N",
        default=d.timing_steps,
        help="optimizer steps timed per backend",
    )
    p.add_argument(
        "--threads",
        type=int_at_least(1),
        default=d.threads,
        metavar="N",
        help="torch CPU threads (default 1: the demo's tensors are too small to gain from more)",
    )
    p.add_argument(
        "--check-steps",
        type=int_at_least(1),
        metavar="N",
        default=d.check_steps,
        help="optimizer steps of the equivalence check",
    )


def cmd_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..ops import resolve_backend
    from . import demo

    if args.d_model % 4:
        parser.error(f"--d-model must be a multiple of 4 (the head count), got {args.d_model}")
    if not args.no_plot:
        check_output_file(parser, "--out", args.out)
    device = resolve_device(parser, args.device)
    try:
        resolve_backend(device, args.backend)
    except RuntimeError as exc:
        parser.error(f"--backend {args.backend}: {exc}")
    cfg = demo.DemoConfig(
        batch_size=args.batch_size,
        grad_accum_steps=args.grad_accum_steps,
        steps=args.steps,
        lr=args.lr,
        amp=args.amp,
        compile=args.compile,
        max_grad_norm=args.max_grad_norm or None,
        seed=args.seed,
        device=str(device),
        out=None if args.no_plot else args.out,
        backend=args.backend,
        loss_norm=args.loss_norm,
        d_model=args.d_model,
        n_layers=args.n_layers,
        max_len=args.max_len,
        timing_steps=args.timing_steps,
        check_steps=args.check_steps,
        threads=args.threads,
    )
    return demo.run(cfg)
