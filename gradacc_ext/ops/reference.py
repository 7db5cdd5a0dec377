"""Pure-PyTorch reference for every gradacc op.

Each function has the same signature and in-place semantics as the op of
the same name in csrc/ops.cpp. It is two things at once:

* the fallback backend when the extension is not built (or backend="torch"),
  computing in float32 like the kernels, with no host synchronisation;
* the oracle of the tests: called on float64 copies it computes in float64.

It performs no argument checks: gradacc_ext.ops validates before calling it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _alpha(alpha: float, alpha_tensor: torch.Tensor | None, dtype: torch.dtype) -> float | torch.Tensor:
    if alpha_tensor is None:
        return alpha
    return alpha_tensor.reshape(()).to(dtype) * alpha


def _accumulated(
    buf: torch.Tensor, grad: torch.Tensor, alpha: float | torch.Tensor, assign: bool, dtype: torch.dtype
) -> torch.Tensor:
    scaled = grad.to(dtype) * alpha
    return scaled if assign else buf.to(dtype) + scaled


def accumulate_(
    bufs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    alpha: float,
    alpha_tensor: torch.Tensor | None,
    assign: bool,
) -> None:
    for buf, grad in zip(bufs, grads, strict=True):
        dtype = _compute_dtype(buf, grad)
        buf.copy_(_accumulated(buf, grad, _alpha(alpha, alpha_tensor, dtype), assign, dtype))


def _norm_of(values: Sequence[torch.Tensor], norm_type: float, dtype: torch.dtype, device: torch.device):
    # One partial result per tensor, then combined: concatenating the tensors (and squaring the
    # concatenation) would put gradient-sized temporaries beside the buffers at every window end.
    values = [v.reshape(-1) for v in values if v.numel()]
    if not values:
        return torch.zeros((), dtype=dtype, device=device)
    # amax/amin drop no NaN: a NaN anywhere makes the norm NaN, like the kernels.
    if norm_type == math.inf:
        return torch.stack([v.to(dtype).abs().amax() for v in values]).amax()
    if norm_type == -math.inf:
        return torch.stack([v.to(dtype).abs().amin() for v in values]).amin()
    if norm_type == 0:  # NaN counts as nonzero, as in torch.linalg.vector_norm (and no int64 copy of a mask)
        return torch.stack([torch.count_nonzero(v) for v in values]).sum().to(dtype)
    if norm_type == 1:
        return torch.stack([v.to(dtype).abs().sum() for v in values]).sum()
    if norm_type == 2:
        return torch.stack([v.to(dtype).square().sum() for v in values]).sum().sqrt()
    return torch.stack([v.to(dtype).abs().pow(norm_type).sum() for v in values]).sum().pow(1.0 / norm_type)


def accumulate_final_(
    bufs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    alpha: float,
    alpha_tensor: torch.Tensor | None,
    assign: bool,
    found_inf: torch.Tensor,
    norm_acc: torch.Tensor,
    norm_type: float,
) -> None:
    accumulate_(bufs, grads, alpha, alpha_tensor, assign)
    stored = [b for b in bufs if b.numel()]  # statistics describe what was stored, as in the kernels
    if not stored:
        return
    flag = torch.stack([(~torch.isfinite(b)).any() for b in stored]).any()
    found_inf.copy_(torch.where(flag, torch.ones_like(found_inf), found_inf))
    dtype = _compute_dtype(norm_acc, *stored)
    # The partial: the sum of squares (2) or max |x| (inf) of what was stored, added into norm_acc.
    if norm_type == math.inf:
        part = torch.stack([b.to(dtype).abs().amax() for b in stored]).amax()
        total = torch.maximum(norm_acc.reshape(()).to(dtype), part)  # NaN propagates, as in the kernels
    else:
        part = torch.stack([b.to(dtype).square().sum() for b in stored]).sum()
        total = norm_acc.reshape(()).to(dtype) + part
    norm_acc.copy_(total.reshape(norm_acc.shape))


def global_norm(
    tensors: Sequence[torch.Tensor], norm_type: float, per_tensor: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    device = tensors[0].device if tensors else torch.device("cpu")
    dtype = _compute_dtype(*tensors)
    total = _norm_of(list(tensors), norm_type, dtype, device)
    if per_tensor:
        each = [_norm_of([t], norm_type, dtype, device) for t in tensors]
        per = torch.stack(each) if each else torch.empty(0, dtype=dtype, device=device)
    else:
        per = torch.empty(0, dtype=dtype, device=device)
    return total, per


def unscale_(tensors: Sequence[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    if not tensors:
        return
    nonfinite = torch.stack([(~torch.isfinite(t)).any() for t in tensors]).any()
    for t in tensors:
        t.copy_(t.to(_compute_dtype(t)) * inv_scale.reshape(()).to(_compute_dtype(t)))
    found_inf.copy_(torch.where(nonfinite, torch.ones_like(found_inf), found_inf))


def clip_coefficient(total_norm: torch.Tensor, max_norm: float, eps: float) -> torch.Tensor:
    """min(1, max_norm / (norm + eps)); NaN stays NaN, as in torch's clip_grad_norm_."""
    return torch.clamp(max_norm / (total_norm.reshape(()) + eps), max=1.0)


def clip_by_norm_(tensors: Sequence[torch.Tensor], total_norm: torch.Tensor, max_norm: float, eps: float) -> None:
    # The kernels read a total_norm of any float dtype and compute the coefficient in fp32, or in
    # float64 for a float64 tensor. A coefficient of exactly 1 leaves every value unchanged, so no
    # host-side branch (and no sync) is needed to skip the no-clip case.
    for t in tensors:
        dtype = _compute_dtype(t)
        t.copy_(t.to(dtype) * clip_coefficient(total_norm.to(dtype), max_norm, eps))


def clip_by_value_(tensors: Sequence[torch.Tensor], clip_value: float) -> None:
    for t in tensors:
        if abs(clip_value) <= torch.finfo(t.dtype).max or math.isinf(clip_value):
            t.clamp_(-clip_value, clip_value)
        else:  # beyond a 16-bit type's range (torch refuses the scalar): clamp in float32, as the kernels do
            t.copy_(t.to(_compute_dtype(t)).clamp_(-clip_value, clip_value))
