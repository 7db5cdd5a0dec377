"""The Python-facing ops: each picks a backend and calls it.

Backends, chosen per call from the tensors' device and `backend=`:

* ``"auto"`` (default): the compiled kernels when the extension is loaded and
  was built for the tensors' device (CUDA kernels for CUDA tensors, the C++
  CPU kernels for CPU tensors); otherwise the pure-PyTorch reference.
* ``"ext"``: the compiled kernels, or a RuntimeError saying why they are absent.
* ``"torch"``: the pure-PyTorch reference (gradacc_ext.reference).

All ops keep scales, norms and flags on the device: none synchronises the
host, so all are CUDA-graph capturable on the compiled path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Literal

import torch

from . import _aliasing, _checks, reference
from . import coverage as gpu_coverage
from ._loader import LOAD_REASON, extension_has_cuda, extension_loaded
from .constants import DEFAULT_EPS
from .core_args import Accumulate, AccumulateFinal, ClipByNorm, ClipByValue, CoreOp, GlobalNorm, Unscale

Backend = Literal["auto", "ext", "torch"]
BACKENDS = ("auto", "ext", "torch")
_CPU = torch.device("cpu")
# Each compiled op's one overload, found on its first call: calling the OpOverload skips the packet's Python
# __call__ and overload resolution, and the dict skips the getattr on torch.ops.gradacc (about 5,500
# instructions a call, 2.8 per tensor at 2,000; callgrind). torch.compile traces the dict and the overload.
_OVERLOADS: dict[str, torch._ops.OpOverload] = {}


def resolve_backend(device: torch.device | str, backend: str = "auto") -> tuple[str, str]:
    """Returns ("ext" | "torch", reason) for tensors on `device`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(device, torch.device):  # the public ops pass their tensors' device
        device = torch.device(device)
    if backend == "torch":
        return "torch", "backend='torch' was requested"
    # device.type builds a new string on each read (about 3,000 instructions): a CPU tensor's device is
    # compared whole instead, on every call of the public ops.
    kind = "cpu" if device == _CPU else device.type
    if not extension_loaded():
        available, reason = False, LOAD_REASON
    elif kind == "cpu":
        available, reason = True, "C++ CPU kernels"
    elif kind == "cuda":
        available = extension_has_cuda()
        reason = "fused CUDA kernels" if available else "the extension was built without CUDA kernels"
        if available:  # checked once per GPU: its arch and its driver's kernel-parameter limit
            coverage = gpu_coverage.device_coverage(gpu_coverage.cuda_index(device))
            available, reason = coverage.covered, (reason if coverage.covered else coverage.reason)
    else:
        available, reason = False, f"no compiled kernels for device type {kind!r}"
    if backend == "ext" and not available:
        raise RuntimeError(f"backend='ext' requested for {device} tensors, but {reason}")
    return ("ext", reason) if available else ("torch", reason + "; using the pure-PyTorch reference")


def _run(
    name: str,
    device: torch.device,
    backend: str,
    validate: Callable[[], object],
    args: tuple,
    on_empty: Callable[[], object] | None = None,
    reference_impl: ModuleType = reference,
    reference_args: tuple | None = None,
):
    """Calls op `name` on the chosen backend.

    The compiled ops check their arguments in C++ (csrc/binding.cpp), which
    costs microseconds even for thousands of tensors, and only after one fails
    run the equivalent Python checks, for the error's type; the reference path
    runs those checks first. Either way nothing is written when an
    argument is rejected. `on_empty` is the result for empty lists (nothing to
    launch): their arguments, backend included, are still checked.
    `reference_impl` is the module holding the op's pure-PyTorch reference, called with
    `reference_args` where given (the optimizer steps' argument record), else with `args`.
    """
    chosen, _ = resolve_backend(device, backend)
    if on_empty is not None:
        validate()
        return on_empty()
    if chosen == "ext":
        try:
            compiled = _OVERLOADS.get(name)
            if compiled is None:
                compiled = _OVERLOADS[name] = getattr(torch.ops.gradacc, name).default
            return compiled(*args)
        except RuntimeError:
            # The stable ABI turns every C++ error into a RuntimeError. The Python checks are the C++
            # ones (same order, same messages): re-run them for the contract's ValueError/TypeError.
            validate()
            raise
    validate()
    return getattr(reference_impl, name)(*(args if reference_args is None else reference_args))


def _nothing() -> None:
    return None


def _as_list(tensors: Iterable[torch.Tensor] | torch.Tensor, arg: str) -> list[torch.Tensor]:
    """The list a public op hands on. A None item is named by the op's validation (_defined, first in each
    validate()): on the compiled path that runs only after torch refused the list (Tensor[] takes no None), so
    the common call pays no Python pass over the items for it."""
    if type(tensors) is list:
        # Handed on as given: copying costs about 9 instructions per tensor (callgrind), on every call. Between
        # the checks and the op nothing runs the caller's code but a __torch_function__ override or mode that
        # the leaf check's requires_grad reads reach; the native pass walks the list as a list iterator would.
        return tensors
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    try:
        return list(tensors)
    except TypeError:
        raise TypeError(f"{arg} must be a tensor or a sequence of tensors, got {type(tensors).__name__}") from None


def _defined(op: str, **lists: list[torch.Tensor]) -> None:
    for arg, tensors in lists.items():
        _checks.check_defined(op, arg, tensors)


def _split_scale(scale: float | torch.Tensor) -> tuple[float, torch.Tensor | None]:
    if isinstance(scale, torch.Tensor):
        return 1.0, scale
    return float(scale), None


def _call(a: CoreOp, backend: Backend) -> object:
    """Runs core op `a` on the chosen backend: every check its record and its outputs' memory call for, in the
    binding's order (csrc/binding.cpp, csrc/aliasing.cpp), and nothing written when one fails."""
    op = a.op
    if a.OUTPUT_LISTS and torch.is_grad_enabled():  # without grad mode no leaf is refused: no dict to build
        _aliasing.check_leaves_in_grad_mode(op, {arg: getattr(a, arg) for arg in a.OUTPUT_LISTS})

    def validate() -> None:  # the compiled path runs it only after the op refused the call
        lists, outputs, inputs = a.lists(), a.tensor_args(outputs=True), a.tensor_args(outputs=False)
        _defined(op, **lists)
        if a.OUTPUT_LISTS:
            input_lists = {arg: tensors for arg, tensors in inputs.items() if arg in lists}
            output_lists = {arg: getattr(a, arg) for arg in a.OUTPUT_LISTS}
            _aliasing.check_disjoint(op, output_lists, input_lists or None, in_place_pairs=a.IN_PLACE_PAIRS)
        a.check()
        if a.OUTPUT_LISTS and len(a.TENSORS) > len(a.LISTS):  # a one-tensor argument beside the lists
            _aliasing.check_scalars_disjoint(op, outputs, inputs)

    return _run(a.NAME, a.device(), backend, validate, a.args(), a.empty_result if a.empty() else None)


def accumulate_(
    bufs: Iterable[torch.Tensor],
    grads: Iterable[torch.Tensor],
    scale: float | torch.Tensor = 1.0,
    *,
    assign: bool = False,
    backend: Backend = "auto",
) -> None:
    """bufs[i] += scale * grads[i] (or = with assign=True) over whole lists.

    grads are fp32, fp16 or bf16; each buffer is fp32 or its grad's dtype.
    `scale` is a float or a one-element float32 tensor on the lists' device.
    """
    bufs, grads = _as_list(bufs, "bufs"), _as_list(grads, "grads")
    alpha, alpha_tensor = _split_scale(scale)
    _call(Accumulate(bufs=bufs, grads=grads, alpha=alpha, alpha_tensor=alpha_tensor, assign=assign), backend)


def accumulate_final_(
    bufs: Iterable[torch.Tensor],
    grads: Iterable[torch.Tensor],
    found_inf: torch.Tensor,
    norm_acc: torch.Tensor,
    scale: float | torch.Tensor = 1.0,
    *,
    assign: bool = False,
    norm_type: float = 2.0,
    backend: Backend = "auto",
) -> None:
    """One bucket of a window's last fold, in one pass over memory: accumulate_ plus the norm's partial.

    bufs[i] = (assign ? 0 : bufs[i]) + scale * grads[i], as accumulate_; then found_inf (one-element
    float32) is set to 1 if any stored result is non-finite (never cleared), and the results' partial
    norm is ADDED into norm_acc (one-element float32): their sum of squares for norm_type 2, their
    max |x| for inf (NaN propagates). The results stay as stored (scaled): called once per bucket, the
    calls' partials add up to the folded views' statistic, whose norm is sqrt(sum) (or the max), times
    any inverse loss scale. Only 2 and inf have a partial that adds; another order is refused.
    """
    bufs, grads = _as_list(bufs, "bufs"), _as_list(grads, "grads")
    alpha, alpha_tensor = _split_scale(scale)
    record = AccumulateFinal(
        bufs=bufs, grads=grads, alpha=alpha, alpha_tensor=alpha_tensor, assign=assign, found_inf=found_inf,
        norm_acc=norm_acc, norm_type=float(norm_type),
    )  # fmt: skip
    _call(record, backend)


def global_norm(
    tensors: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    *,
    per_tensor: bool = False,
    backend: Backend = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Global p-norm of a list as a 0-d device tensor, for any order
    torch.linalg.vector_norm takes (0, 1, 2, inf and -inf are exact special
    cases; another p goes through exp(p log|x|)). The norm of nothing is 0.

    Tensors may be contiguous or dense in another memory order (channels_last),
    and float64 as well as fp32/fp16/bf16. Deterministic (bitwise-equal over
    runs), accumulated in fp32 into a float32 result, or in double into a
    float64 result when the list holds a float64 tensor. With per_tensor=True
    returns (total, per_tensor_norms).
    """
    record = GlobalNorm(tensors=_as_list(tensors, "tensors"), norm_type=float(norm_type), per_tensor=per_tensor)
    total, each = _call(record, backend)
    return (total, each) if per_tensor else total


def unscale_(
    tensors: Iterable[torch.Tensor],
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    backend: Backend = "auto",
) -> None:
    """tensors *= inv_scale; found_inf = 1 if any input is non-finite (fp32, fp16, bf16)."""
    _call(Unscale(tensors=_as_list(tensors, "tensors"), inv_scale=inv_scale, found_inf=found_inf), backend)


def clip_by_norm_(
    tensors: Iterable[torch.Tensor],
    total_norm: torch.Tensor | float,
    max_norm: float,
    eps: float = DEFAULT_EPS,
    *,
    backend: Backend = "auto",
) -> None:
    """tensors *= min(1, max_norm / (total_norm + eps)), the coefficient computed on the device in fp32
    (in double for float64 tensors).

    total_norm is a one-element tensor of any float dtype or a Python number. max_norm=inf leaves the
    tensors unchanged, max_norm=0 zeroes them (torch's semantics).
    """
    tensors = _as_list(tensors, "tensors")
    if isinstance(total_norm, (int, float)):
        # float64 keeps the number exact until the kernel rounds it, like a float64 tensor.
        total_norm = torch.tensor(float(total_norm), dtype=torch.float64, device=_checks.list_device(tensors))
    _call(ClipByNorm(tensors=tensors, total_norm=total_norm, max_norm=float(max_norm), eps=float(eps)), backend)


def clip_grad_norm_(
    tensors: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    eps: float = DEFAULT_EPS,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Global norm, then clip by it; returns the (pre-clip) norm. No host sync."""
    op = "gradacc.clip_grad_norm_"
    tensors = _as_list(tensors, "tensors")
    _defined(op, tensors=tensors)  # a composite: named here, before the norm's own checks would name their op
    _aliasing.check_outputs(op, tensors=tensors)  # before the norm pass (clip_by_norm_ checks again)
    _checks.check_max_norm(op, float(max_norm))
    # The clip's own range checks before the norm runs: a bad eps must not cost a norm pass first.
    _checks.check_fits_float(op, "max_norm", float(max_norm), tensors)
    _checks.check_fits_float(op, "eps", float(eps), tensors)
    total = global_norm(tensors, norm_type, backend=backend)
    clip_by_norm_(tensors, total, max_norm, eps, backend=backend)
    return total


def clip_by_value_(
    tensors: Iterable[torch.Tensor],
    clip_value: float,
    *,
    backend: Backend = "auto",
) -> None:
    """tensors = clamp(tensors, -clip_value, clip_value), torch.clamp's semantics: 0 zeroes, inf keeps, a
    negative clip_value sets every element to it; NaN stays NaN."""
    _call(ClipByValue(tensors=_as_list(tensors, "tensors"), clip_value=float(clip_value)), backend)
