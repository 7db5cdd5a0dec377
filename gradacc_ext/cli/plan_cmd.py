"""`gradacc plan`: accumulation steps, effective batch and scaled LR for a target batch."""

from __future__ import annotations

import argparse
import json

import torch

from .args import float_above, int_at_least


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
