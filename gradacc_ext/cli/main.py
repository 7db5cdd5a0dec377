"""The `gradacc` command (also `python -m gradacc_ext`): info, plan, bench, demo.

Every numeric flag is parsed by a type that states its accepted range, so bad
input ends as an argparse error (exit code 2) such as
"argument --grad-accum-steps: must be an integer >= 1, got 0".
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .. import __version__

DEVICES = ("auto", "cpu", "cuda")


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def float_above(low: float, *, inclusive: bool = False, note: str = "") -> Callable[[str], float]:
    bound = f"{'>=' if inclusive else '>'} {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        ok = (
            value is not None
            and value == value
            and value != float("inf")
            and (value >= low if inclusive else value > low)
        )
        if not ok:
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}{note}, got {text}")
        return value

    parse.__name__ = f"number {bound}"
    return parse


def resolve_device(parser: argparse.ArgumentParser, name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine (torch.cuda.is_available() is False)")
    return torch.device(name)


# -- info -----------------------------------------------------------------------------------------------------------


def cmd_info(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from . import envinfo

    info = envinfo.collect()
    print(json.dumps(info, indent=2) if args.json else envinfo.render(info))
    return 0


# -- plan -----------------------------------------------------------------------------------------------------------


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    from .probe import AMP_DTYPES, PRESETS

    p.add_argument(
        "--target-batch",
        type=int_at_least(1),
        required=True,
        metavar="N",
        help="target effective batch (items per optimizer step, all ranks)",
    )
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument(
        "--micro-batch", type=int_at_least(1), metavar="N", help="the largest micro-batch per rank that fits"
    )
    size.add_argument(
        "--probe", action="store_true", help="find the largest micro-batch of a built-in model on this GPU (CUDA only)"
    )
    p.add_argument("--world-size", type=int_at_least(1), default=1, metavar="N", help="data-parallel ranks")
    p.add_argument("--base-lr", type=float_above(0), metavar="LR", help="the learning rate tuned at --base-batch")
    p.add_argument(
        "--base-batch", type=int_at_least(1), metavar="N", help="the effective batch --base-lr was tuned for"
    )
    p.add_argument(
        "--rounding",
        choices=("nearest", "down", "up"),
        default="nearest",
        help="when the target is not reachable exactly",
    )
    p.add_argument("--probe-model", choices=tuple(PRESETS), default="gpt2-small", help="model for --probe")
    p.add_argument("--probe-seq-len", type=int_at_least(2), default=1024, metavar="T", help="tokens per sequence")
    p.add_argument("--probe-amp", choices=tuple(AMP_DTYPES), default="bf16", help="autocast for --probe")
    p.add_argument("--probe-max", type=int_at_least(1), default=1024, metavar="N", help="largest size --probe tries")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def cmd_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .. import planning

    if (args.base_lr is None) != (args.base_batch is None):
        parser.error("--base-lr and --base-batch go together: the LR and the effective batch it was tuned for")
    if args.probe:
        from .probe import NO_CUDA, probe_micro_batch

        if not torch.cuda.is_available():
            parser.error(NO_CUDA)
        try:
            micro = probe_micro_batch(args.probe_model, args.probe_seq_len, args.probe_amp, args.probe_max)
        except ValueError as exc:
            parser.error(str(exc))
        source = (
            f"probed: {args.probe_model}, {args.probe_seq_len} tokens, amp {args.probe_amp} "
            f"on {torch.cuda.get_device_name()}"
        )
    else:
        micro, source = args.micro_batch, "given"
    try:
        plan = planning.plan_accumulation(args.target_batch, micro, args.world_size, args.rounding)
    except ValueError as exc:
        parser.error(str(exc))
    result = {
        "target_batch_size": plan.target_batch_size,
        "max_micro_batch_size": micro,
        "max_micro_batch_source": source,
        "micro_batch_size": plan.micro_batch_size,
        "accumulation_steps": plan.accumulation_steps,
        "world_size": plan.world_size,
        "effective_batch_size": plan.effective_batch_size,
        "exact": plan.effective_batch_size == plan.target_batch_size,
        "note": plan.note,
    }
    if args.base_lr is not None:
        result.update(
            base_lr=args.base_lr,
            base_batch_size=args.base_batch,
            lr_linear=planning.scale_lr_linear(args.base_lr, args.base_batch, plan.effective_batch_size),
            lr_sqrt=planning.scale_lr_sqrt(args.base_lr, args.base_batch, plan.effective_batch_size),
        )
    print(json.dumps(result, indent=2) if args.json else render_plan(result))
    return 0


def render_plan(result: dict) -> str:
    rows = [
        ("target effective batch", str(result["target_batch_size"])),
        ("max micro-batch per rank", f"{result['max_micro_batch_size']} ({result['max_micro_batch_source']})"),
        ("micro-batch per rank", str(result["micro_batch_size"])),
        ("accumulation steps", str(result["accumulation_steps"])),
        ("world size", str(result["world_size"])),
        ("effective batch", f"{result['effective_batch_size']} ({'exact' if result['exact'] else 'not exact'})"),
    ]
    if "base_lr" in result:
        rows += [
            ("base LR", f"{result['base_lr']:.4g} at effective batch {result['base_batch_size']}"),
            ("scaled LR, linear", f"{result['lr_linear']:.4g} (SGD-style: lr x batch ratio)"),
            ("scaled LR, sqrt", f"{result['lr_sqrt']:.4g} (Adam-style: lr x sqrt(batch ratio))"),
        ]
    width = max(len(name) for name, _ in rows)
    rule = f"{'':-<{width + 1}}+{'':-<40}"
    lines = [f"{'quantity':<{width}} | value", rule]
    lines += [f"{name:<{width}} | {value}" for name, value in rows]
    lines.append(rule)
    lines.append(result["note"])
    lines.append(
        f"micro-batch {result['micro_batch_size']} x steps {result['accumulation_steps']} x world "
        f"{result['world_size']} = effective batch {result['effective_batch_size']}"
    )
    return "\n".join(lines)


# -- bench ----------------------------------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .. import benchmarking

    device = resolve_device(parser, args.device)
    print(f"running the quick benchmark on {device} (the full harness: python benchmarks/compare.py)...", flush=True)
    print(benchmarking.quick_table(str(device)))
    return 0


# -- demo -----------------------------------------------------------------------------------------------------------


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    from .demo import LOSS_NORMS, DemoConfig

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
    p.add_argument("--max-len", type=int_at_least(8), metavar="N", default=d.max_len, help="longest sequence (tokens)")
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


# -- parser ---------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradacc", description="gradacc_ext: fused gradient accumulation for PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"gradacc_ext {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{info,plan,bench,demo}", required=True)
    defaults = {"formatter_class": argparse.ArgumentDefaultsHelpFormatter}

    info = sub.add_parser("info", **defaults, help="versions, compiled GPU archs and the backend each op uses")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.set_defaults(handler=cmd_info, parser=info)

    plan = sub.add_parser(
        "plan", **defaults, help="accumulation steps, effective batch and scaled LR for a target batch"
    )
    add_plan_arguments(plan)
    plan.set_defaults(handler=cmd_plan, parser=plan)

    bench = sub.add_parser("bench", **defaults, help="the quick benchmark table on this machine")
    bench.add_argument("--device", choices=DEVICES, default="auto", help="auto: cuda when available, else cpu")
    bench.set_defaults(handler=cmd_bench, parser=bench)

    demo = sub.add_parser("demo", **defaults, help="train a tiny causal LM with accumulation and verify it is exact")
    add_demo_arguments(demo)
    demo.set_defaults(handler=cmd_demo, parser=demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Errors found after parsing go through the subcommand's own parser, so the usage line fits.
    return args.handler(args, args.parser)


if __name__ == "__main__":
    sys.exit(main())
