"""Fake (meta) kernels for torch.compile, one per op of csrc/ops.cpp.

In-place ops return nothing, so their fakes only describe "no output"; the
functional global_norm describes its two float32 outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def register() -> None:
    @torch.library.register_fake("gradacc::accumulate_")
    def _accumulate(bufs, grads, alpha, alpha_tensor, assign) -> None:
        return None

    @torch.library.register_fake("gradacc::accumulate_final_")
    def _accumulate_final(bufs, grads, alpha, alpha_tensor, assign, inv_scale, found_inf, norm_out, norm_type) -> None:
        return None

    @torch.library.register_fake("gradacc::global_norm")
    def _global_norm(tensors: Sequence[torch.Tensor], norm_type: float, per_tensor: bool):
        first = tensors[0]
        total = first.new_empty((), dtype=torch.float32)
        each = first.new_empty((len(tensors) if per_tensor else 0,), dtype=torch.float32)
        return total, each

    @torch.library.register_fake("gradacc::unscale_")
    def _unscale(tensors, inv_scale, found_inf) -> None:
        return None

    @torch.library.register_fake("gradacc::clip_by_norm_")
    def _clip_by_norm(tensors, total_norm, max_norm, eps) -> None:
        return None

    @torch.library.register_fake("gradacc::clip_by_value_")
    def _clip_by_value(tensors, clip_value) -> None:
        return None
