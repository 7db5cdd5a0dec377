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

Both backends refuse alike: the compiled ops in C++ (csrc/binding.cpp check_disjoint, nanoseconds per tensor),
then this module names the pair; the reference path runs it first. The leaf check stays in Python.
Each tensor's byte range [data_ptr, data_ptr + nbytes) (distinct allocations never
share addresses, so no storage lookup is needed), one sort, one sweep. Dense tensors (all the ops
take) overlap in memory exactly when their ranges do. About 0.3-0.7 us of CPU per tensor (docs/traps.md).
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


def _spans(arg: str, tensors: Sequence[torch.Tensor]) -> list[tuple[int, int, str, int]]:
    """(start, end, arg, index) of each tensor's bytes. nbytes is a dense tensor's extent; for another one
    (which the ops' own checks refuse after this one) it is shorter, and whichever error comes first is right."""
    try:  # the common case in two comprehensions: a C call each per tensor, no branches
        starts, sizes = [t.data_ptr() for t in tensors], [t.nbytes for t in tensors]
    except (AttributeError, RuntimeError):  # None, or a layout without a data pointer: the ops' checks name it
        keep = [(i, t) for i, t in enumerate(tensors) if t is not None and t.layout is torch.strided]
        return [(s, s + n, arg, i) for s, n, i in ((t.data_ptr(), t.nbytes, i) for i, t in keep) if s and n]
    # a meta tensor's data pointer is 0 (no memory); an empty tensor holds no bytes
    return [(s, s + n, arg, i) for i, (s, n) in enumerate(zip(starts, sizes, strict=True)) if s and n]


def check_leaves(op: str, **outputs: Sequence[torch.Tensor]) -> None:
    """Raises when an output is an autograd leaf that requires grad while grad mode is on (both backends; the
    compiled ops cannot see requires_grad). Optimizers and clips run under no_grad: no pass at all there."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return
    for arg, tensors in outputs.items():
        for i, t in enumerate(tensors):
            if t is not None and t.requires_grad and t.is_leaf:
                raise RuntimeError(LEAF.format(op=op, arg=arg, i=i))


def check_disjoint(op: str, **outputs: Sequence[torch.Tensor]) -> None:
    """Raises when two outputs (in one list or across the lists named) share memory. Part of each op's Python
    validation: it runs before the reference path, and after a compiled op refused the call (the binding's
    check_disjoint finds the overlap in C++ at a few ns per tensor; this names the pair in the contract's
    ValueError). Tensors another check refuses (None, not strided, meta) are skipped here, so that check names them."""
    if torch.compiler.is_compiling():  # traced tensors have no addresses; the eager call checks
        return
    if sum(len(tensors) for tensors in outputs.values()) < 2:
        return  # the accumulator folds one gradient per call: nothing to overlap with
    spans: list[tuple[int, int, str, int]] = []
    for arg, tensors in outputs.items():
        spans += _spans(arg, tensors)
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


def check_outputs(op: str, **outputs: Sequence[torch.Tensor]) -> None:
    """Both checks at once, for a composite op that runs several kernels (clip_grad_norm_)."""
    check_leaves(op, **outputs)
    check_disjoint(op, **outputs)
