r"""Instructions per list item of the ops' calls, counted by callgrind: a measure the machine's load does not change.

    python benchmarks/op_instructions.py [--tensors 2000] [--numel 16] [--calls 10]

re-runs itself under `valgrind --tool=callgrind --instr-atstart=no`, so Python and torch start uninstrumented
(4x faster than counting from the start); the child builds the lists, warms every call up, switches the
counting on (`callgrind_control -i on`), then runs each (op, caller) pair through its own C builtin (`sum`,
`min`, ...; CARRIERS), whose inclusive count in the profile is that pair's cost alone: everything below the Python call,
argument parsing, dispatch, the boxed kernel, the checks, the kernel and the clean-up. Printed per call and
per list item (one tensor for unscale_, one (buf, grad) pair for accumulate_).

Callers: "raw" is `torch.ops.gradacc.<op>`, "public" `gradacc_ext.ops.<op>` (Python's checks too: what users
call), "eager" torch's own (`torch._foreach_add_`, `torch._amp_foreach_non_finite_check_and_unscale_`), and
"accumulator" the public op as the accumulator's `Buffers.add` calls it (views of one flat buffer, in address
order, grad mode off as in backward). To compare two trees, run it with each tree's root first on the path
(`PYTHONPATH=<root>`).
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable

# (op, caller) -> the C function that carries it, as callgrind names it; each one's inclusive count is one pair's,
# so none may run inside the ops themselves (they call any(): it carries nothing here).
MARKERS = {
    ("accumulate_", "raw"): "builtin_sum",
    ("accumulate_", "public"): "builtin_min",
    ("accumulate_", "eager"): "builtin_max",
    ("accumulate_", "accumulator"): "builtin_sorted",
    ("unscale_", "raw"): "filter_next",
    ("unscale_", "public"): "builtin_all",
    ("unscale_", "eager"): "functools_reduce",
}
# Runs `fn` n times under the builtin `marker` names (all goes on while the items are truthy).
CARRIERS: dict[str, Callable[[Callable[[], object], int], object]] = {
    "builtin_sum": lambda fn, n: sum(map(lambda _: (fn(), 0)[1], range(n))),
    "builtin_min": lambda fn, n: min(map(lambda _: (fn(), 0)[1], range(n))),
    "builtin_max": lambda fn, n: max(map(lambda _: (fn(), 0)[1], range(n))),
    "builtin_sorted": lambda fn, n: sorted(map(lambda _: (fn(), 0)[1], range(n))),
    "filter_next": lambda fn, n: list(filter(None, map(lambda _: (fn(), 0)[1], range(n)))),
    "builtin_all": lambda fn, n: all(map(lambda _: (fn(), 1)[1], range(n))),
    "functools_reduce": lambda fn, n: functools.reduce(lambda acc, _: (fn(), acc)[1], range(n), 0),
}


def _calls(n: int, numel: int) -> dict[tuple[str, str], Callable[[], object]]:
    import torch

    import gradacc_ext.ops as gops

    bufs = [torch.randn(numel) for _ in range(n)]  # separate allocations, in no address order: the sort's worst
    grads = [torch.randn(numel) for _ in range(n)]
    tensors = [torch.randn(numel) for _ in range(n)]
    inv_scale, found_inf = torch.ones(1), torch.zeros(1)  # x1: values stay finite however often it runs
    raw = torch.ops.gradacc
    calls = {
        ("accumulate_", "raw"): lambda: raw.accumulate_(bufs, grads, 1.0, None, False),
        ("accumulate_", "public"): lambda: gops.accumulate_(bufs, grads, 1.0),
        ("accumulate_", "eager"): lambda: torch._foreach_add_(bufs, grads),
        ("unscale_", "raw"): lambda: raw.unscale_(tensors, inv_scale, found_inf),
        ("unscale_", "public"): lambda: gops.unscale_(tensors, inv_scale, found_inf),
        ("unscale_", "eager"): lambda: torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale),
    }
    calls[("accumulate_", "accumulator")] = _accumulator_fold(n, numel, grads)
    return calls


def _accumulator_fold(n: int, numel: int, grads: list) -> Callable[[], object]:
    """What the accumulator's Buffers.add calls: the public op over views of one flat buffer, in address order,
    with gradients that live outside it, under no_grad (its hooks run in backward)."""
    import torch

    import gradacc_ext.ops as gops

    views = list(torch.randn(n * numel).split(numel))

    def fold() -> None:
        with torch.no_grad():  # as in backward, where its hooks run
            gops.accumulate_(views, grads, 1.0)

    return fold


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    calls = _calls(args.tensors, args.numel)
    for fn in calls.values():  # warm: first-call caches, lazy imports
        fn()
        fn()
    subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], check=True, capture_output=True)
    for key, fn in calls.items():
        CARRIERS[MARKERS[key]](fn, args.calls)


def measure(args: argparse.Namespace) -> dict[tuple[str, str], float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        sizes = [f"--tensors={args.tensors}", f"--numel={args.numel}", f"--calls={args.calls}"]
        tool = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
        cmd = [*tool, sys.executable, __file__, "--child", *sizes]
        subprocess.run(cmd, check=True, capture_output=True)
        report = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", out], check=True,
                                capture_output=True, text=True).stdout  # fmt: skip
    counts = {}
    for key, marker in MARKERS.items():
        found = re.search(rf"^\s*([\d,]+) .*\.c:{marker}\b", report, re.M)
        if found:
            counts[key] = int(found.group(1).replace(",", "")) / args.calls
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=2000, help="list items (default: %(default)s)")
    parser.add_argument("--numel", type=int, default=16, help="elements per tensor (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=10, help="counted calls of each pair (default: %(default)s)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    counts = measure(args)
    print(f"{args.tensors} fp32 tensors of {args.numel}, 1 thread, {args.calls} counted calls (callgrind Ir)")
    for key in MARKERS:
        if key in counts:
            per_item = counts[key] / args.tensors
            print(f"{key[0]:12s} {key[1]:12s} {counts[key]:14,.0f} per call {per_item:8,.0f} per item")
        else:
            print(f"{key[0]:12s} {key[1]:12s} n/a")


if __name__ == "__main__":
    main()
