"""`gradacc selftest`: every compiled kernel against the pure-PyTorch reference, in seconds.

The command to run right after installing: each kernel of selftest_kernels.KERNELS runs on small
random inputs (every dtype pair it takes, odd sizes, an unaligned view, more tensors than one
launch holds) through the compiled kernels on the device, and through the reference on the CPU;
the results must agree within one rounding of their dtype. One line per kernel; the exit status
is 1 when a kernel disagrees (or the compiled kernels are absent), naming it.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import zlib
from collections.abc import Iterator

import torch

from ..ops import resolve_backend
from .selftest_kernels import KERNELS, LAYOUTS, Inputs, Kernel

# rtol = atol per stored dtype: one rounding of the dtype, or the fp32 arithmetic's for fp32 and fp64 results
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2,
             torch.uint8: 1}  # int8 optimizer state codes: within one code (compared as integers, no rtol)  # fmt: skip
FALLBACK_ADVICE = (
    "Until this is fixed, set GRADACC_NO_EXT=1 to run every op on the pure-PyTorch reference (same results, "
    "slower), and report the lines above with the output of `gradacc info`."
)


def add_selftest_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="the kernels to check: the CUDA kernels or the C++ CPU kernels",
    )
    p.add_argument(
        "--layouts",
        default=",".join(LAYOUTS),
        help="comma list of odd, unaligned, many (fewer runs faster, e.g. under compute-sanitizer)",
    )


def mismatch(kernel: Kernel, got: list[torch.Tensor], want: list[torch.Tensor]) -> str | None:
    """Why `got` (the kernels' results, on the CPU) disagrees with the reference's `want`, or None."""
    if len(got) != len(want):
        return f"{len(got)} results, the reference {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.dtype != w.dtype or g.shape != w.shape:
            return f"result {i} is {g.dtype} {list(g.shape)}, the reference's {w.dtype} {list(w.shape)}"
        tol = TOLERANCE[g.dtype]
        if g.dtype == torch.uint8:
            g, w = g.int(), w.int()
        if not torch.allclose(g, w, rtol=0 if g.dtype == torch.int32 else tol, atol=tol, equal_nan=True):
            diff = (g.double() - w.double()).abs().nan_to_num(float("inf"))
            return f"result {i} ({g.dtype}, {g.numel()} elements): max |diff| {diff.max().item():.3g} > {tol:g}"
    if kernel.max_bits_differ is not None:
        low = [(g, w) for g, w in zip(got, want, strict=True) if g.dtype in (torch.float16, torch.bfloat16)]
        differ, total = sum(int((g != w).sum()) for g, w in low), sum(g.numel() for g, _ in low)
        if differ > kernel.max_bits_differ * total:
            return f"{differ} of {total} 16-bit values differ from the reference's bits"
    return None


@contextlib.contextmanager
def one_cpu_thread() -> Iterator[None]:
    """The reference issues many small ops; on a busy machine each op of a multi-thread pool waits on the
    others (several times slower), and the reference's result does not depend on its threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def check_kernel(kernel: Kernel, device: str, layouts: list[str]) -> str | None:
    """Runs every case and layout of `kernel`; the first disagreement, or None."""
    for case in kernel.cases:
        for layout in layouts:
            seed = zlib.crc32(f"{kernel.name}/{case}/{layout}".encode())
            got = [t.cpu() for t in kernel.run(Inputs(device, layout, seed), case, "ext")]
            with one_cpu_thread():
                want = kernel.run(Inputs("cpu", layout, seed), case, "torch")
            why = mismatch(kernel, got, want)
            if why is not None:
                return f"{case}, {layout}: {why}"
    return None


def cmd_selftest(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown or not layouts:
        parser.error(f"--layouts: unknown layout(s) {', '.join(unknown) or '(none given)'}; expected {LAYOUTS}")
    try:
        _, where = resolve_backend(args.device, "ext")
    except RuntimeError as exc:
        print(f"selftest FAILED: no compiled kernels to check on {args.device}: {exc}")
        return 1
    print(f"gradacc selftest: the {where} on {args.device} against the pure-PyTorch reference")
    failed = []
    start = time.perf_counter()
    for kernel in KERNELS:
        t0 = time.perf_counter()
        try:
            why = check_kernel(kernel, args.device, layouts)
        except Exception as exc:  # a launch error or a refused argument is this kernel's failure, not the run's
            why = f"raised {type(exc).__name__}: {exc}"
        if args.device == "cuda":
            torch.cuda.synchronize()
        cases = f"{len(kernel.cases)} cases x {len(layouts)} layouts"
        status = "ok  " if why is None else "FAIL"
        seconds = f"{time.perf_counter() - t0:6.2f} s"
        print(f"{status}  {kernel.name:<18} {cases:<22} {seconds}" + (f"  {why}" if why else ""))
        if why is not None:
            failed.append(kernel.name)
    if failed:
        names = ", ".join(failed)
        print(f"selftest FAILED on {args.device}: {names} disagree(s) with the reference. {FALLBACK_ADVICE}")
        return 1
    total = time.perf_counter() - start
    print(f"selftest passed: {len(KERNELS)} kernels agree with the reference on {args.device} ({total:.1f} s)")
    return 0
