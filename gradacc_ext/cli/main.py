"""The `gradacc` command (also `python -m gradacc_ext`): info, selftest, plan, bench, demo.

Each subcommand's flags and handler live in their own module (selftest, plan_cmd, bench_cmd,
demo_cmd); argument types shared by them in args. Errors found after parsing go
through the subcommand's own parser, so they end as a usage line and exit code 2,
never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from .. import __version__
from .bench_cmd import add_bench_arguments, cmd_bench
from .demo_cmd import add_demo_arguments, cmd_demo
from .plan_cmd import add_plan_arguments, cmd_plan
from .selftest import add_selftest_arguments, cmd_selftest

SIGPIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a tool whose reader went away


def cmd_info(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from . import envinfo

    info = envinfo.collect()
    print(json.dumps(info, indent=2) if args.json else envinfo.render(info))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradacc", description="gradacc_ext: fused gradient accumulation for PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"gradacc_ext {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{info,selftest,plan,bench,demo}", required=True)
    defaults = {"formatter_class": argparse.ArgumentDefaultsHelpFormatter}

    info = sub.add_parser("info", **defaults, help="versions, compiled GPU archs and the backend each op uses")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.set_defaults(handler=cmd_info, parser=info)

    selftest = sub.add_parser(
        "selftest", **defaults, help="check every compiled kernel against the pure-PyTorch reference (seconds)"
    )
    add_selftest_arguments(selftest)
    selftest.set_defaults(handler=cmd_selftest, parser=selftest)

    plan = sub.add_parser(
        "plan", **defaults, help="accumulation steps, effective batch and scaled LR for a target batch"
    )
    add_plan_arguments(plan)
    plan.set_defaults(handler=cmd_plan, parser=plan)

    bench = sub.add_parser("bench", **defaults, help="the benchmark table on this machine (within a minute)")
    add_bench_arguments(bench)
    bench.set_defaults(handler=cmd_bench, parser=bench)

    demo = sub.add_parser("demo", **defaults, help="train a tiny causal LM with accumulation and verify it is exact")
    add_demo_arguments(demo)
    demo.set_defaults(handler=cmd_demo, parser=demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.handler(args, args.parser)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below, not at interpreter exit
    except BrokenPipeError:
        # `gradacc info | head -1`: the reader has gone. Point stdout at /dev/null so the interpreter's
        # final flush cannot raise again, and exit like a tool stopped by SIGPIPE.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return SIGPIPE_EXIT
    return code


if __name__ == "__main__":
    sys.exit(main())
