"""The implementations compared in every cell, as functions of a GradState.

* gradacc:   the fused ops (backend="auto": CUDA kernels on CUDA tensors, the
             C++ CPU kernels on CPU tensors).
* eager:     what a PyTorch user writes today: torch._foreach_add_ of a bf16
             list into an fp32 list (not fused: torch loops add_ per tensor),
             the GradScaler.unscale_ kernel (_amp_foreach_non_finite_check_and_unscale_)
             and torch.nn.utils.clip_grad_norm_(foreach=True); unscale alone is that same
             unscale kernel on its own.
* compile:   torch.compile of exactly the eager functions below.
* reference: gradacc's pure-PyTorch reference (backend="torch").

Every implementation returns the norm it computed (or None) and writes its
results into the state; the runner checks they all agree before timing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import ops
from ..ops import reference
from ..ops.constants import DEFAULT_EPS
from .operations import Operation
from .state import GradState

IMPLS = ("gradacc", "eager", "compile", "reference")
IMPL_TITLES = {
    "gradacc": "gradacc fused",
    "eager": "torch eager",
    "compile": "torch.compile",
    "reference": "reference (backend=torch)",
}
OURS = "gradacc"
PEERS = ("eager", "compile", "reference")

Impl = Callable[[GradState], "torch.Tensor | None"]


# ---- the eager peer: plain functions of tensors, so torch.compile can take them as they are ----


def eager_accumulate(bufs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    torch._foreach_add_(bufs, grads)


def eager_tail(
    bufs: list[torch.Tensor],
    grads: list[torch.Tensor],
    params: list[torch.nn.Parameter],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    max_norm: float,
) -> torch.Tensor:
    torch._foreach_add_(bufs, grads)
    torch._amp_foreach_non_finite_check_and_unscale_(bufs, found_inf, inv_scale)
    return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)  # params' .grad are the bufs


def eager_norm(bufs: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.get_total_norm(bufs, 2.0, foreach=True)


def eager_unscale(bufs: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    torch._amp_foreach_non_finite_check_and_unscale_(bufs, found_inf, inv_scale)


def eager_clip(params: list[torch.nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm, foreach=True)


def _torch_impl(op: Operation, compiled: bool) -> Impl:
    def wrap(fn: Callable) -> Callable:
        return torch.compile(fn) if compiled else fn

    if op.key in ("acc_bf16", "acc_fp32"):
        acc = wrap(eager_accumulate)
        return lambda s: acc(s.bufs, s.grads)
    if op.key in ("tail", "tail_adamw"):
        tail = wrap(eager_tail)
        return lambda s: tail(s.bufs, s.grads, s.params, s.found_inf, s.inv_scale, s.max_norm)
    if op.key == "norm":
        norm = wrap(eager_norm)
        return lambda s: norm(s.bufs)
    if op.unscale_alone:
        unscale = wrap(eager_unscale)
        return lambda s: unscale(s.bufs, s.found_inf, s.inv_scale)
    clip = wrap(eager_clip)
    return lambda s: clip(s.params, s.max_norm, s.clip_norm)


def _gradacc_impl(op: Operation, backend: str) -> Impl:
    if op.key in ("acc_bf16", "acc_fp32"):
        return lambda s: ops.accumulate_(s.bufs, s.grads, backend=backend)
    if op.key in ("tail", "tail_adamw"):

        def tail(s: GradState) -> torch.Tensor:
            # The last fold adds the sums' sum of squares as it writes them (left scaled); then one pass applies
            # inv_scale x the clip coefficient: the unscale and the clip, as the accumulator's window end does.
            s.norm_out.zero_()
            ops.accumulate_final_(s.bufs, s.grads, s.found_inf, s.norm_out, backend=backend)
            s.norm_out.copy_(s.norm_out.sqrt() * s.inv_scale)
            mult = s.inv_scale * reference.clip_coefficient(s.norm_out, s.max_norm, DEFAULT_EPS)
            ops.unscale_(s.bufs, mult.reshape(1), s.found_inf, backend=backend)
            return s.norm_out

        return tail
    if op.key == "norm":
        return lambda s: ops.global_norm(s.bufs, backend=backend)
    if op.unscale_alone:
        return lambda s: ops.unscale_(s.bufs, s.inv_scale, s.found_inf, backend=backend)
    return lambda s: ops.clip_by_norm_(s.bufs, s.clip_norm, s.max_norm, backend=backend)


def _with_optimizer(tail: Impl) -> Impl:
    def step(s: GradState) -> torch.Tensor | None:
        norm = tail(s)
        s.optimizer.step()  # the same AdamW, eager, after every implementation's tail
        return norm

    return step


def build_impl(name: str, op: Operation) -> Impl:
    if name not in IMPLS:
        raise ValueError(f"implementation must be one of {IMPLS}, got {name!r}")
    if name in ("eager", "compile"):
        impl = _torch_impl(op, compiled=name == "compile")
    else:
        impl = _gradacc_impl(op, "auto" if name == OURS else "torch")
    return _with_optimizer(impl) if op.needs_optimizer else impl
