"""Outputs an op would write unsafely: memory shared within its output lists, and autograd leaves.

The kernels write their output lists in parallel (at::parallel_for chunks on the CPU, blocks on
CUDA), so a tensor listed twice, or two views that overlap, has two workers read-modify-write the
same bytes: a race (accumulate_([b, b], [g, g]) over 4M elements differed from the sequential
result in 2 of 20 runs on 2 threads), while the reference path applies the op twice in order.
Neither is what the caller meant, so both backends refuse, with one message, before either runs.

A leaf tensor that requires grad, passed as an output while grad mode is on, is refused too: the
reference path's in-place ops raise torch's "a leaf Variable that requires grad is being used in an
in-place operation" there, and the compiled ops cannot see requires_grad (the stable ABI has no
getter), so they would write it silently. Under torch.no_grad() both write it, as torch's
optimizers do.

Host-side only: each tensor's byte range [data_ptr, data_ptr + extent) (distinct allocations never
share addresses, so no storage lookup is needed), one sort, one sweep. Dense tensors (all the ops
take) overlap in memory exactly when their ranges do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LEAF = (
    "{op}: {arg}[{i}] is a leaf tensor that requires grad, which this op writes in place (torch: a leaf Variable "
    "that requires grad is being used in an in-place operation); call it under torch.no_grad(), or pass the "
    "tensor's .detach() or its .grad"
)
SHARED = (
    "{op}: {a}[{i}] and {b}[{j}] share memory (the same tensor, or overlapping views of one storage); this op "
    "writes its outputs in parallel, so each output may be given once and may not overlap another: pass each "
    "tensor once, and views that do not overlap"
)


def _extent(t: torch.Tensor) -> int:
    """Bytes from the first element to one past the last (0 for an empty tensor)."""
    if t.is_contiguous():
        return t.nbytes
    if t.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))) * t.element_size()


def check_outputs(op: str, **outputs: Sequence[torch.Tensor]) -> None:
    """Raises when an output is an autograd leaf that requires grad (grad mode on), or when two outputs
    (in one list or across the lists named) share memory. Tensors another check refuses (None, not
    strided, meta) are skipped here, so that check names them."""
    if torch.compiler.is_compiling():  # traced tensors have no addresses; the eager call checks
        return
    grad_mode = torch.is_grad_enabled()
    spans: list[tuple[int, int, str, int]] = []
    for arg, tensors in outputs.items():
        for i, t in enumerate(tensors):
            if t is None or t.layout != torch.strided or t.device.type == "meta":
                continue
            if grad_mode and t.requires_grad and t.is_leaf:
                raise RuntimeError(LEAF.format(op=op, arg=arg, i=i))
            size = _extent(t)
            if size:
                start = t.data_ptr()
                spans.append((start, start + size, arg, i))
    if len(spans) < 2:
        return
    spans.sort()
    reach = spans[0]  # the span reaching furthest so far
    for span in spans[1:]:
        if span[0] < reach[1]:
            first, second = sorted((reach, span), key=lambda s: (list(outputs).index(s[2]), s[3]))
            raise ValueError(SHARED.format(op=op, a=first[2], i=first[3], b=second[2], j=second[3]))
        if span[1] > reach[1]:
            reach = span
