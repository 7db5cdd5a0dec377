"""Outputs an op would write unsafely: memory an output shares with another output or with an input, and
autograd leaves.

The kernels write their output lists in parallel (at::parallel_for chunks on the CPU, blocks on
CUDA) while they read the inputs, so a tensor listed twice, two views that overlap, or an input that
is another item's output has two workers touch the same bytes at once: a race (accumulate_([b, b],
[g, g]) over 4M elements differed from the sequential result in 2 of 20 runs on 2 threads;
accumulate_([a, b], [b, a]) gave 4 different results in 5 runs), while the reference path applies
the items in order. Neither is what the caller meant, so both backends refuse, with one message,
before either runs. The one exception is an op's in-place pair where the op defines it: accumulate_
and accumulate_final_ take grads[i] that is exactly bufs[i] (bufs[i] += alpha * bufs[i], elementwise,
equal on both backends). The optimizer steps take none: their reference applies weight decay to
params[i] before it reads grads[i], the kernels read grads[i] first.

A leaf tensor that requires grad, passed as an output while grad mode is on, is refused too: the
reference path's in-place ops raise torch's "a leaf Variable that requires grad is being used in an
in-place operation" there, and the compiled ops cannot see requires_grad (the stable ABI has no
getter), so they would write it silently. Under torch.no_grad() both write it, as torch's
optimizers do.

Both backends refuse alike: the compiled ops in C++ (csrc/aliasing.cpp, the same rule, order and
message), and this module before the reference path and after a compiled op refused the call. The
leaf check stays in Python, its requires_grad pass compiled where the extension is (csrc/requires_grad.h).
Each tensor's byte range [data_ptr, data_ptr + nbytes) (distinct allocations never share addresses, so no
storage lookup is needed): the outputs sorted and swept once, then each input compared with the outputs'
hull, or found by binary search inside it. Dense tensors (all the ops take) overlap in memory exactly when
their ranges do.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Mapping, Sequence
from typing import NoReturn

import torch

from . import _loader

LEAF = (
    "{op}: {arg}[{i}] is a leaf tensor that requires grad, which this op writes in place (torch: a leaf Variable "
    "that requires grad is being used in an in-place operation); call it under torch.no_grad(), or pass the "
    "tensor's .detach() or its .grad"
)
SHARED = (
    "{op}: {a} and {b} share memory (the same tensor, or overlapping views of one storage); this op "
    "writes its outputs in parallel, so each output may be given once and may not overlap another: pass each "
    "tensor once, and views that do not overlap"
)

# A list argument, one tensor (a scale, flag or norm: named without an index), or None (an absent optional one).
Arg = Sequence[torch.Tensor] | torch.Tensor | None
Range = tuple[int, int, int, int]  # (start, end, argument's place in the call, index): the binding's sort key


def _ranges(k: int, tensors: Arg) -> list[Range]:
    """Each tensor's bytes [start, end) with its place. nbytes is a dense tensor's extent; for another one
    (which the ops' own checks refuse before this one) it is shorter, and whichever error comes first is right."""
    if tensors is None:
        return []
    if isinstance(tensors, torch.Tensor):
        tensors = (tensors,)
    try:  # the common case in two comprehensions: a C call each per tensor, no branches
        starts, sizes = [t.data_ptr() for t in tensors], [t.nbytes for t in tensors]
    except (AttributeError, RuntimeError):  # None, or a layout without a data pointer: the ops' checks name it
        keep = [(i, t) for i, t in enumerate(tensors) if t is not None and t.layout is torch.strided]
        return [(s, s + n, k, i) for s, n, i in ((t.data_ptr(), t.nbytes, i) for i, t in keep) if s and n]
    # a meta tensor's data pointer is 0 (no memory); an empty tensor holds no bytes
    return [(s, s + n, k, i) for i, (s, n) in enumerate(zip(starts, sizes, strict=True)) if s and n]


def check_leaves(op: str, **outputs: Sequence[torch.Tensor]) -> None:
    """Raises when an output is an autograd leaf that requires grad while grad mode is on (both backends; the
    compiled ops cannot see requires_grad). Optimizers and clips run under no_grad: no pass at all there, and
    in grad mode one C-level pass over requires_grad, the rest only when a tensor requires grad."""
    if torch.is_grad_enabled():
        check_leaves_in_grad_mode(op, outputs)


def check_leaves_in_grad_mode(op: str, outputs: Mapping[str, Sequence[torch.Tensor]]) -> None:
    """check_leaves for a caller that found grad mode on (the public ops' _call: one grad-mode read a call)."""
    if torch.compiler.is_compiling():
        return
    for arg, tensors in outputs.items():
        try:
            if not _any_requires_grad(tensors):
                continue
        except AttributeError:  # a None item, which the op's validation names, or no tensor (the loop raises)
            pass
        for i, t in enumerate(tensors):
            if t is not None and t.requires_grad and t.is_leaf:
                raise RuntimeError(LEAF.format(op=op, arg=arg, i=i))


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
# The compiled pass (csrc/requires_grad.h), or None without the extension: it calls torch.Tensor's requires_grad
# getter itself for plain tensors, found in torch._C.TensorBase's getset table.
_NATIVE_PASS = getattr(getattr(_loader._C, "module", None), "any_requires_grad", None)
_TENSOR, _TENSOR_BASE = torch.Tensor, torch._C.TensorBase


def _any_requires_grad(tensors: Sequence[torch.Tensor | None]) -> bool:
    """Whether any item requires grad. The compiled extension's pass (None items skipped) costs about half of
    the Python one per tensor (callgrind); without it, or for a sequence that is not a list, the Python pass
    (AttributeError on a None item)."""
    if _NATIVE_PASS is not None and type(tensors) is list:
        return _NATIVE_PASS(tensors, _TENSOR, _TENSOR_BASE)
    return any(map(_REQUIRES_GRAD, tensors))


def check_disjoint(
    op: str, outputs: Mapping[str, Arg], inputs: Mapping[str, Arg] | None = None, *, in_place_pairs: bool = False
) -> None:
    """Raises when an item of an output list shares memory with another output item or with an item of an input
    list (csrc/aliasing.h, rule for rule, so both name the same pair); one-tensor arguments are
    check_scalars_disjoint's. `in_place_pairs`: the first input list's item i may be exactly the first output
    list's item i (same bytes and dtype), where the op defines that in place (accumulate_, accumulate_final_).
    Part of each op's Python validation, first: it runs before the reference path, and after a compiled op
    refused the call. Tensors another check refuses (None, not strided, meta) are skipped here."""
    if torch.compiler.is_compiling():  # traced tensors have no addresses; the eager call checks
        return
    inputs = inputs or {}
    args = {**outputs, **inputs}
    names = list(args)
    out = [r for k, arg in enumerate(outputs) if _is_list(outputs[arg]) for r in _ranges(k, outputs[arg])]
    if not out:
        return
    out.sort()
    reach = out[0]  # the output reaching furthest so far
    for r in out[1:]:
        if r[0] < reach[1]:
            _shared(op, names, args, reach, r)
        if r[1] > reach[1]:
            reach = r
    # Disjoint and sorted, the outputs' ends rise with their starts: the last output that starts before an input
    # ends is the only one that can reach into it.
    starts, low, high = [r[0] for r in out], out[0][0], reach[1]
    first_input = len(outputs)
    for k, arg in enumerate(inputs, start=first_input):
        for r in _ranges(k, inputs[arg]) if _is_list(inputs[arg]) else ():
            if r[1] <= low or r[0] >= high:
                continue
            at = bisect.bisect_left(starts, r[1])
            hit = out[at - 1] if at else None
            if hit is None or hit[1] <= r[0]:
                continue
            if in_place_pairs and k == first_input and hit[2:] == (0, r[3]) and hit[:2] == r[:2]:
                pair = args[names[0]][r[3]], args[names[k]][r[3]]
                if pair[0].dtype == pair[1].dtype:
                    continue
            _shared(op, names, args, hit, r)


def check_scalars_disjoint(op: str, outputs: Mapping[str, Arg], inputs: Mapping[str, Arg] | None = None) -> None:
    """The one-tensor arguments' part of the rule (csrc/aliasing.h check_scalars_disjoint), made last, once they
    are checked: each one (outputs first) against every tensor of every other argument but two inputs."""
    if torch.compiler.is_compiling():
        return
    inputs = inputs or {}
    args = {**outputs, **inputs}
    names, first_input = list(args), len(outputs)
    for s, arg in enumerate(names):
        if _is_list(args[arg]) or not (one := _ranges(s, args[arg])):
            continue
        for k, other in enumerate(names):
            if k == s or (k >= first_input and s >= first_input):  # itself; two inputs may share
                continue
            for r in _ranges(k, args[other]):
                if r[0] < one[0][1] and one[0][0] < r[1]:
                    _shared(op, names, args, one[0], r)


def _is_list(tensors: Arg) -> bool:
    return tensors is not None and not isinstance(tensors, torch.Tensor)


def _shared(op: str, names: list[str], args: Mapping[str, Arg], a: Range, b: Range) -> NoReturn:
    first, second = sorted((a, b), key=lambda r: r[2:])  # named in the call's order

    def name(r: Range) -> str:
        arg = names[r[2]]
        return arg if isinstance(args[arg], torch.Tensor) else f"{arg}[{r[3]}]"

    raise ValueError(SHARED.format(op=op, a=name(first), b=name(second)))


def check_outputs(op: str, **outputs: Sequence[torch.Tensor]) -> None:
    """Both checks at once, for a composite op that runs several kernels (clip_grad_norm_)."""
    check_leaves(op, **outputs)
    check_disjoint(op, outputs)
