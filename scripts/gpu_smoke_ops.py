"""Every op once per layout on one device, compiled kernels against the pure-PyTorch reference.

Small and quick on purpose: scripts/gpu_verify.sh runs it under compute-sanitizer (racecheck is
~100x slower than a plain run) and in its --dry-run on the CPU. Layouts: odd sizes across chunk
boundaries, unaligned views, mixed dtypes, and more tensors than one launch's metadata holds.
The fused optimizer steps (adamw_step_, sgd_step_) run per layout for fp32, bf16 params with fp32
master weights and with stochastic rounding (fp32 grads), fp16 and fp64; their reference runs on
the CPU (the pure-PyTorch steps launch a dozen kernels per tensor, too many under racecheck).

    python scripts/gpu_smoke_ops.py --device cuda
"""

from __future__ import annotations

import argparse
import math

import torch

import gradacc_ext

ODD = [1, 7, 65535, 65537, 131073]
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # per stored dtype
F32, BF16 = torch.float32, torch.bfloat16
# name: (param dtype, grad dtype, mode); 16-bit params read fp32 grads as they do from the accumulator's buffers
OPTIM_CASES = {
    "fp32": (F32, F32, "nearest"),
    "bf16-master": (BF16, F32, "master"),
    "bf16-stochastic": (BF16, F32, "stochastic"),
    "fp16": (torch.float16, torch.float16, "nearest"),
    "fp64": (torch.float64, torch.float64, "nearest"),
}


def sizes_of(layout: str, gen: torch.Generator) -> list[int]:
    return {"many": [int(n) for n in torch.randint(1, 64, (1400,), generator=gen)]}.get(layout, ODD)


def make(n: int, dtype: torch.dtype, device: str, layout: str, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n + 1, generator=gen).to(dtype).to(device)
    return x[1:] if layout == "unaligned" else x[:n]  # [1:] is one element past the allocation


def lists(device: str, layout: str, gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(fp32 buffers, grads of mixed dtypes) for `layout`."""
    sizes = sizes_of(layout, gen)
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    return (
        [make(n, torch.float32, device, layout, gen) for n in sizes],
        [make(n, dtypes[i % 3], device, layout, gen) for i, n in enumerate(sizes)],
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


def run_optim(device: str, layout: str, case: str, gen: torch.Generator) -> None:
    """adamw_step_ and sgd_step_ (momentum, weight decay, device lr / grad_mult / found_inf; half the
    params on SGD's first step) on `device` against the reference on the CPU."""
    param_dtype, grad_dtype, mode = OPTIM_CASES[case]
    sizes = sizes_of(layout, gen)
    state = torch.float64 if param_dtype == torch.float64 else F32

    def lst(dtype: torch.dtype, positive: bool = False) -> list[torch.Tensor]:
        return [make(n, dtype, device, layout, gen).abs_() if positive else make(n, dtype, device, layout, gen)
                for n in sizes]  # fmt: skip

    params, grads, m, v = lst(param_dtype), lst(grad_dtype), lst(state), lst(state, positive=True)
    masters = [p.to(F32) for p in params] if mode == "master" else []
    adam_steps = [torch.full((1,), float(i % 3), device=device) for i in range(len(sizes))]
    sgd_steps = [torch.full((1,), float(i % 2), device=device) for i in range(len(sizes))]  # 0: the first step
    scalars = {"lr": 1e-2, "grad_mult": 0.75, "found_inf": 0.0}
    outputs = {}
    for backend, where in (("ext", device), ("torch", "cpu")):
        x = [[t.to(where, copy=True) for t in group] for group in (params, grads, m, v, masters, adam_steps, sgd_steps)]
        p_, g_, m_, v_, masters_, adam_steps_, sgd_steps_ = x
        s = {k: torch.full((1,) if k == "found_inf" else (), val, device=where) for k, val in scalars.items()}
        common = dict(master_params=masters_, grad_mult=s["grad_mult"], found_inf=s["found_inf"], mode=mode,
                      seed=7, backend=backend)  # fmt: skip
        gradacc_ext.ops.adamw_step_(p_, g_, m_, v_, adam_steps_, lr=s["lr"], weight_decay=0.1, **common)
        # SGD's momentum buffers: AdamW's exp_avg, already stepped (any fp32 state will do)
        gradacc_ext.ops.sgd_step_(p_, g_, lr=s["lr"], momentum=0.9, weight_decay=0.01, momentum_buffers=m_,
                                  steps=sgd_steps_, **common)  # fmt: skip
        outputs[backend] = [t.cpu() for group in x for t in group]
    check(outputs["ext"], outputs["torch"], f"{layout} {case} adamw+sgd")
    # The tolerance admits one 16-bit ulp everywhere; the rounding (nearest or stochastic from the same
    # seed, step and position) must agree bit for bit but where the fp32 update itself differs in its last bit.
    got, want = outputs["ext"][: len(sizes)], outputs["torch"][: len(sizes)]
    differ = sum(int((g != w).sum()) for g, w in zip(got, want, strict=True))
    if param_dtype in (torch.float16, BF16) and differ > 1e-3 * sum(sizes):
        raise AssertionError(f"{layout} {case}: {differ} of {sum(sizes)} params differ from the reference's bits")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layouts", default="odd,unaligned,many", help="comma list of odd, unaligned, many")
    args = p.parse_args()
    gradacc_ext.resolve_backend(args.device, "ext")  # the compiled kernels must be there: no silent fallback
    gen = torch.Generator().manual_seed(0)
    for layout in args.layouts.split(","):
        run(args.device, layout, gen)
        for case in OPTIM_CASES:
            run_optim(args.device, layout, case, gen)
        print(f"ok  {args.device} {layout} (ops, adamw/sgd: {', '.join(OPTIM_CASES)})")
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
