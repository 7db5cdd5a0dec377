"""gradacc::wgrad_addmm_: a weight gradient accumulated into an fp32 buffer by one mixed-dtype GEMM (CUDA).

    out = beta * out + alpha * (mat1 @ mat2)     # mat1, mat2 bf16/fp16; out float32; beta 0 (assign) or 1

The linear fusion (accumulate/linear_fusion.py) calls it in a bf16/fp16 Linear's backward with
mat1 = grad_output^T and mat2 = input, so the weight gradient never exists as a bf16 tensor: cuBLAS
accumulates the products in fp32 and adds them to the fp32 buffer in its epilogue. It wraps torch's own
aten::addmm.dtype_out (out_dtype=float32), which torch registers for CUDA only. It is a custom op with a
fake kernel so torch.compile sees one opaque, mutating op (Inductor has had trouble with out_dtype), and
probe() checks it once per device against a float64 reference: a torch build where the op is missing or
wrong makes the fusion fall back to the hooks path for those parameters, with the probe's reason.
"""

from __future__ import annotations

import torch

from .constants import HALF_DTYPES

_PROBED: dict[str, str | None] = {}  # device -> None (usable) or why not


def _check(out: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor) -> None:
    if out.dtype != torch.float32:
        raise TypeError(f"gradacc.wgrad_addmm_: out must be float32, got {out.dtype}")
    if mat1.dtype not in HALF_DTYPES or mat2.dtype != mat1.dtype:
        raise TypeError(
            f"gradacc.wgrad_addmm_: mat1 and mat2 must both be float16 or bfloat16, got {mat1.dtype} and {mat2.dtype}"
        )
    if mat1.dim() != 2 or mat2.dim() != 2 or mat1.shape[1] != mat2.shape[0]:
        raise ValueError(
            f"gradacc.wgrad_addmm_: mat1 and mat2 must be matrices [n, k] and [k, m], got {list(mat1.shape)} "
            f"and {list(mat2.shape)}"
        )
    if list(out.shape) != [mat1.shape[0], mat2.shape[1]]:
        raise ValueError(f"gradacc.wgrad_addmm_: out must be [{mat1.shape[0]}, {mat2.shape[1]}], got {list(out.shape)}")


@torch.library.custom_op("gradacc::wgrad_addmm_", mutates_args=("out",), device_types="cuda")
def wgrad_addmm_(out: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, beta: float, alpha: float) -> None:
    _check(out, mat1, mat2)
    torch.addmm(out, mat1, mat2, out.dtype, beta=beta, alpha=alpha, out=out)


@wgrad_addmm_.register_fake
def _(out: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, beta: float, alpha: float) -> None:
    _check(out, mat1, mat2)


def probe(device: torch.device) -> str | None:
    """None when wgrad_addmm_ works on `device` (both beta=0 over NaN and beta=1), else the reason; once per device."""
    key = str(device)
    if key not in _PROBED:
        _PROBED[key] = _probe(device)
    return _PROBED[key]


def _probe(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"torch has no mixed-dtype (bf16/fp16 x bf16/fp16 -> fp32) GEMM on {device.type}"
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(37, 19, generator=g).to(device, torch.bfloat16)
    b = torch.randn(19, 23, generator=g).to(device, torch.bfloat16)
    want = 0.5 * (a.double() @ b.double()) * 3  # beta=0 assigns 0.5*ab, then beta=1 adds it twice more
    out = torch.full((37, 23), float("nan"), device=device)
    try:
        wgrad_addmm_(out, a, b, 0.0, 0.5)
        wgrad_addmm_(out, a, b, 1.0, 1.0)
    except (RuntimeError, TypeError, NotImplementedError) as e:
        return f"aten::addmm.dtype_out failed on {device}: {str(e).splitlines()[0]}"
    if not torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5):
        return f"aten::addmm.dtype_out on {device} disagrees with a float64 reference"
    return None
