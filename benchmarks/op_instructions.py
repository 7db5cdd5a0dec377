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
"accumulator" the accumulator's fold of its own views (`Buffers.add`'s call, where it has one). To compare two
trees, run it from each tree's root (`PYTHONPATH=<root>`); an older tree without a pair prints "n/a".
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

# (op, caller) -> the C builtin that carries it, as callgrind names it; each one's inclusive count is one pair's.
MARKERS = {
    ("accumulate_", "raw"): "builtin_sum",
    ("accumulate_", "public"): "builtin_min",
    ("accumulate_", "eager"): "builtin_max",
    ("accumulate_", "accumulator"): "builtin_sorted",
    ("unscale_", "raw"): "builtin_any",
    ("unscale_", "public"): "builtin_all",
    ("unscale_", "eager"): "functools_reduce",
}
# Runs `fn` n times under the builtin `marker` names (any and all go on while the items are falsy / truthy).
CARRIERS: dict[str, Callable[[Callable[[], object], int], object]] = {
    "builtin_sum": lambda fn, n: sum(map(lambda _: (fn(), 0)[1], range(n))),
    "builtin_min": lambda fn, n: min(map(lambda _: (fn(), 0)[1], range(n))),
    "builtin_max": lambda fn, n: max(map(lambda _: (fn(), 0)[1], range(n))),
    "builtin_sorted": lambda fn, n: sorted(map(lambda _: (fn(), 0)[1], range(n))),
    "builtin_any": lambda fn, n: any(map(lambda _: (fn(), 0)[1], range(n))),
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
    fold = _accumulator_fold(n, numel, grads)
    if fold is not None:
        calls[("accumulate_", "accumulator")] = fold
    return calls


def _accumulator_fold(n: int, numel: int, grads: list) -> Callable[[], object] | None:
    """The accumulator's own call over views of one flat buffer, where this tree has one."""
    import torch

    import gradacc_ext.ops as gops

    flat = torch.randn(n * numel)
    bufs = list(flat.split(numel))

    fold_api = getattr(gops, "FlatViews", None)
    if fold_api is None:
        return None
    views = fold_api(flat, bufs)
    return lambda: gops.accumulate_views_(views, grads, 1.0)


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
