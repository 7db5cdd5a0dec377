"""Fake (meta) kernels for torch.compile, one per op of csrc/ops.cpp.

torch.library also runs these as the ops' Meta kernels, which the dispatcher
picks whenever any argument is a meta tensor. So they run the same argument
checks as the compiled binding (gradacc_ext._checks mirrors
csrc/binding.cpp): a meta tensor mixed into a CPU list is rejected by name,
never silently skipped, and torch.compile reports bad input at trace time.
In-place ops return nothing; global_norm describes its two float32 outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _checks


def _check_tensors(op: str, tensors: Sequence[torch.Tensor], fallback: torch.Tensor | None = None) -> torch.device:
    device = _checks.list_device(tensors, fallback)
    _checks.check_list(op, "tensors", tensors, device)
    return device


def register() -> None:
    @torch.library.register_fake("gradacc::accumulate_")
    def _accumulate(bufs, grads, alpha, alpha_tensor, assign) -> None:
        _checks.check_accumulate("gradacc.accumulate_", bufs, grads, alpha, alpha_tensor)

    @torch.library.register_fake("gradacc::accumulate_final_")
    def _accumulate_final(bufs, grads, alpha, alpha_tensor, assign, inv_scale, found_inf, norm_out, norm_type) -> None:
        op = "gradacc.accumulate_final_"
        _checks.check_accumulate(op, bufs, grads, alpha, alpha_tensor)
        device = _checks.list_device(bufs, norm_out)
        _checks.check_scalar(op, "found_inf", found_inf, device)
        _checks.check_scalar(op, "norm_out", norm_out, device)
        if inv_scale is not None:
            _checks.check_scalar(op, "inv_scale", inv_scale, device)
        _checks.check_norm_type(op, norm_type)

    @torch.library.register_fake("gradacc::global_norm")
    def _global_norm(tensors: Sequence[torch.Tensor], norm_type: float, per_tensor: bool):
        _check_tensors("gradacc.global_norm", tensors)
        _checks.check_norm_type("gradacc.global_norm", norm_type)
        first = tensors[0]
        total = first.new_empty((), dtype=torch.float32)
        each = first.new_empty((len(tensors) if per_tensor else 0,), dtype=torch.float32)
        return total, each

    @torch.library.register_fake("gradacc::unscale_")
    def _unscale(tensors, inv_scale, found_inf) -> None:
        device = _check_tensors("gradacc.unscale_", tensors, found_inf)
        _checks.check_scalar("gradacc.unscale_", "inv_scale", inv_scale, device)
        _checks.check_scalar("gradacc.unscale_", "found_inf", found_inf, device)

    @torch.library.register_fake("gradacc::clip_by_norm_")
    def _clip_by_norm(tensors, total_norm, max_norm, eps) -> None:
        device = _check_tensors("gradacc.clip_by_norm_", tensors, total_norm)
        _checks.check_scalar("gradacc.clip_by_norm_", "total_norm", total_norm, device)
        _checks.check_positive("gradacc.clip_by_norm_", "max_norm", max_norm)

    @torch.library.register_fake("gradacc::clip_by_value_")
    def _clip_by_value(tensors, clip_value) -> None:
        _check_tensors("gradacc.clip_by_value_", tensors)
        _checks.check_positive("gradacc.clip_by_value_", "clip_value", clip_value)
