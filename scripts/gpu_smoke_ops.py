"""Every op once per layout on one device, compiled kernels against the pure-PyTorch reference.

Small and quick on purpose: scripts/gpu_verify.sh runs it under compute-sanitizer (racecheck is
~100x slower than a plain run) and in its --dry-run on the CPU. Layouts: odd sizes across chunk
boundaries, unaligned views, mixed dtypes, and more tensors than one launch's metadata holds.

    python scripts/gpu_smoke_ops.py --device cuda
"""

from __future__ import annotations

import argparse
import math

import torch

import gradacc_ext

ODD = [1, 7, 65535, 65537, 131073]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # relative, per stored dtype


def lists(device: str, layout: str, gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(fp32 buffers, grads of mixed dtypes) for `layout`."""
    sizes = {"odd": ODD, "unaligned": ODD, "many": [int(n) for n in torch.randint(1, 64, (1400,), generator=gen)]}
    dtypes = (torch.float32, torch.float16, torch.bfloat16)

    def make(n: int, dtype: torch.dtype) -> torch.Tensor:
        x = torch.randn(n + 1, generator=gen).to(dtype).to(device)
        return x[1:] if layout == "unaligned" else x[:n]  # [1:] is one element past the allocation

    sizes_ = sizes[layout]
    return (
        [make(n, torch.float32) for n in sizes_],
        [make(n, dtypes[i % 3]) for i, n in enumerate(sizes_)],
    )


def check(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=TOL[g.dtype], atol=TOL[g.dtype], msg=lambda m, i=i: f"{what}[{i}]: {m}")


def run(device: str, layout: str, gen: torch.Generator) -> None:
    bufs, grads = lists(device, layout, gen)
    outputs = {}
    for backend in ("ext", "torch"):
        b = [t.clone() for t in bufs]
        g = [t.clone() for t in grads]
        scalar = {"device": device, "dtype": torch.float32}
        found, norm = torch.zeros(1, **scalar), torch.zeros((), **scalar)
        gradacc_ext.accumulate_(b, g, 0.5, backend=backend)
        gradacc_ext.accumulate_final_(b, g, found, norm, 0.5, inv_scale=torch.full((), 0.25, **scalar), backend=backend)
        total, each = gradacc_ext.global_norm(g, math.inf, per_tensor=True, backend=backend)
        gradacc_ext.clip_by_norm_(b, norm, 0.5 * norm.item(), backend=backend)
        gradacc_ext.clip_by_value_(g, 0.5, backend=backend)
        gradacc_ext.unscale_(g, torch.full((), 2.0, **scalar), found, backend=backend)
        outputs[backend] = (b, g, [found, norm, total, each])
    for k, what in enumerate(("bufs", "grads", "scalars")):
        check(outputs["ext"][k], outputs["torch"][k], f"{layout} {what}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layouts", default="odd,unaligned,many", help="comma list of odd, unaligned, many")
    args = p.parse_args()
    gradacc_ext.resolve_backend(args.device, "ext")  # the compiled kernels must be there: no silent fallback
    gen = torch.Generator().manual_seed(0)
    for layout in args.layouts.split(","):
        run(args.device, layout, gen)
        print(f"ok  {args.device} {layout}")
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
