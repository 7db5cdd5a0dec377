"""Fake (meta) kernels for torch.compile, one per op of csrc/ops.cpp.

torch.library also runs these as the ops' Meta kernels, which the dispatcher
picks whenever any argument is a meta tensor. So they run the same argument
checks as the compiled binding (gradacc_ext._checks mirrors
csrc/binding.cpp): a meta tensor mixed into a CPU list is rejected by name,
never silently skipped, and torch.compile reports bad input at trace time.
In-place ops return nothing; global_norm describes its two outputs (float32, or float64 for a
list that holds a float64 tensor).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _checks


def register() -> None:
    @torch.library.register_fake("gradacc::accumulate_")
    def _accumulate(bufs, grads, alpha, alpha_tensor, assign) -> None:
        _checks.check_accumulate("gradacc.accumulate_", bufs, grads, alpha, alpha_tensor)

    @torch.library.register_fake("gradacc::accumulate_final_")
    def _accumulate_final(bufs, grads, alpha, alpha_tensor, assign, found_inf, norm_acc, norm_type) -> None:
        _checks.check_accumulate_final(
            "gradacc.accumulate_final_", bufs, grads, alpha, alpha_tensor, found_inf, norm_acc, norm_type
        )

    @torch.library.register_fake("gradacc::global_norm")
    def _global_norm(tensors: Sequence[torch.Tensor], norm_type: float, per_tensor: bool):
        _checks.check_global_norm("gradacc.global_norm", tensors, norm_type)
        first = tensors[0]
        dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
        total = first.new_empty((), dtype=dtype)
        each = first.new_empty((len(tensors) if per_tensor else 0,), dtype=dtype)
        return total, each

    @torch.library.register_fake("gradacc::unscale_")
    def _unscale(tensors, inv_scale, found_inf) -> None:
        _checks.check_unscale("gradacc.unscale_", tensors, inv_scale, found_inf)

    @torch.library.register_fake("gradacc::clip_by_norm_")
    def _clip_by_norm(tensors, total_norm, max_norm, eps) -> None:
        _checks.check_clip_by_norm("gradacc.clip_by_norm_", tensors, total_norm, max_norm, eps)

    @torch.library.register_fake("gradacc::clip_by_value_")
    def _clip_by_value(tensors, clip_value) -> None:
        _checks.check_clip_by_value("gradacc.clip_by_value_", tensors, clip_value)
