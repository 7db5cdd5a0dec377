"""The accumulator's own gradient buffers: one flat buffer per buffer dtype, per-parameter views.

Gradients are added into the views as autograd produces them (GradHooks
hands them over in buckets) and param.grad is dropped at once, so autograd
writes a new gradient next time and no zeroing pass is ever needed: the
first contribution of a window is written with assign=True. Which views
hold this window's sum is recorded by the buffers' WindowSums
(window_sums.py), the one way anything writes them during a micro-step;
GradBuffers reads that record at the window's end. A parameter
that gets no gradient in a micro-step contributes nothing to it; one that
gets none in the whole window is shown to the optimizer with grad None, as
in a plain loop.

Layout: parameters in reverse registration order (the order backward
produces their gradients, as DDP's reducer lays out its buckets), so a
bucket is usually a contiguous range; every view starts on an ALIGN-byte
boundary so the kernels' vectorised paths apply to every view. The padding
between views is never read or written by any op.

The flat buffers are allocated on a window's first gradient; with
release=True (config.release_buffers) they are freed after every step, and
re-creating them costs no zeroing pass (the first contribution assigns).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Protocol

import torch

from .. import ops
from ..ops import reference
from ..ops.constants import HALF_DTYPES
from ..optim.shards import is_sharded
from . import param_grads
from .window_sums import WindowSums

if TYPE_CHECKING:
    from .fold_norm import FoldNorm

ALIGN = 16  # bytes: one 128-bit vector load; the CUDA kernels' vector width and the CPU's SSE/NEON width


def _float64_ops() -> SimpleNamespace:
    """The op calls for float64 buffers. The norm and the clips are the public ops, which take float64 lists
    (computed in double); accumulate_ and unscale_ pair 16/32-bit lists only, so theirs is gradacc_ext.reference,
    which computes in the tensors' own precision: float64 models accumulate and normalise in float64."""

    def accumulate_(bufs, grads, scale=1.0, *, assign=False, backend=None):
        alpha, tensor = (1.0, scale) if isinstance(scale, torch.Tensor) else (float(scale), None)
        reference.accumulate_(bufs, grads, alpha, tensor, assign)

    def unscale_(tensors, inv_scale, found_inf, *, backend=None):
        reference.unscale_(tensors, inv_scale, found_inf)

    return SimpleNamespace(
        accumulate_=accumulate_,
        unscale_=unscale_,
        global_norm=ops.global_norm,
        clip_by_norm_=ops.clip_by_norm_,
        clip_by_value_=ops.clip_by_value_,
    )


class Shards(Protocol):
    """Maps sharded parameters to what the buffers hold (gradacc_ext.distributed's strategies implement it)."""

    def layout(self, params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]: ...  # the local shards

    def local_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None: ...  # a gradient's local shard

    def param_grad(self, index: int, grad: torch.Tensor) -> torch.Tensor: ...  # what the optimizer gets


class GradBuffers:
    """Flat accumulation buffers for `params` (trainable, on one device).

    shards: for sharded (FSDP2 DTensor) parameters, the buffers mirror each local
    shard (`layout`), take gradients' local shards and show the optimizer
    DTensor gradients; None: plain parameters.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        accum_dtype: torch.dtype | None,
        backend: str,
        *,
        release: bool = False,
        shards: Shards | None = None,
    ) -> None:
        self.params = list(params)
        self.backend = backend
        self.release_after_step = release
        if shards is None and any(is_sharded(p) for p in self.params):
            # Local-shard shapes and a cross-shard norm come from gradacc_ext.distributed's FSDP2 strategy.
            raise TypeError(
                "GradientAccumulator: DTensor (FSDP2 fully_shard) parameters need the fully_shard-ed model passed "
                "to the accumulator (it lays the buffers over the local shards)"
            )
        self.shards = shards
        self.layout = shards.layout(self.params) if shards is not None else self.params
        devices = {t.device for t in self.layout}
        if len(devices) > 1:
            raise ValueError(
                "GradientAccumulator: all trainable parameters must be on one device, "
                f"found {sorted(map(str, devices))}"
            )
        self.device = devices.pop() if devices else torch.device("cpu")
        self.buf_dtypes = [
            accum_dtype if (accum_dtype is not None and t.dtype in HALF_DTYPES) else t.dtype for t in self.layout
        ]
        self.dtypes = list(dict.fromkeys(self.buf_dtypes))
        # Element offset of each parameter's view in its dtype's flat buffer, and each flat's size.
        self.offsets = [0] * len(self.params)
        self.sizes: dict[torch.dtype, int] = {}
        for dtype in self.dtypes:
            step = max(1, ALIGN // dtype.itemsize)
            offset = 0
            for i in reversed(range(len(self.params))):
                if self.buf_dtypes[i] == dtype:
                    self.offsets[i] = offset
                    offset += -(-self.layout[i].numel() // step) * step
            self.sizes[dtype] = offset
        self.flats: dict[torch.dtype, torch.Tensor] = {}
        self.views: list[torch.Tensor] = []
        # Parameters whose buffer dtype differs from their own get their gradient cast into a
        # param-dtype copy for the optimizer step only (optimizers require grad.dtype == param.dtype);
        # the copies are freed right after the step.
        self._cast_index = [i for i, d in enumerate(self.buf_dtypes) if d != self.params[i].dtype]
        self.ops = _float64_ops() if torch.float64 in self.dtypes else ops
        self.sums = WindowSums(self)  # the one owner of which views hold this window's sum (window_sums.py)

    def _ensure(self) -> None:
        """Allocates the flat buffers (uninitialised: every view's first write assigns)."""
        if self.flats:
            return
        self.flats = {d: torch.empty(n, dtype=d, device=self.device) for d, n in self.sizes.items()}
        self.views = [
            self.flats[d][o : o + p.numel()].view(p.shape)
            for p, d, o in zip(self.layout, self.buf_dtypes, self.offsets, strict=True)
        ]

    @property
    def allocated(self) -> bool:
        return bool(self.flats)

    # -- per micro-step (called by WindowSums, which decides assign) ----------------------------------------------

    def accumulate(
        self,
        index: Sequence[int],
        grads: Sequence[torch.Tensor],
        scale: float | torch.Tensor,
        *,
        assign: bool,
        norm: FoldNorm | None = None,
    ) -> None:
        """views[index] = (or +=, assign=False) scale * grads, in one multi-tensor launch; with `norm` (the window's
        last fold) the same pass adds the results' partial norm and found-inf flag into it."""
        self._ensure()
        views = [self.views[i] for i in index]
        grads = [_dense(self._local(g), self.params[i]) for i, g in zip(index, grads, strict=True)]
        if norm is None:
            self.ops.accumulate_(views, grads, scale, assign=assign, backend=self.backend)
        else:
            self.ops.accumulate_final_(
                views, grads, norm.found_inf, norm.partial, scale,
                assign=assign, norm_type=norm.norm_type, backend=self.backend,
            )  # fmt: skip

    # -- window end -------------------------------------------------------------------------------------------------

    def window_views(self) -> list[torch.Tensor]:
        return [self.views[i] for i in self.sums.indices()]

    def grads_by_param(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """param -> its sum in the buffers, for the params that got a gradient this window (a fused step's input)."""
        return {self.params[i]: self.views[i] for i in self.sums.indices()}

    def norm(self, norm_type: float) -> torch.Tensor:
        """The norm of the window's sums as they stand (read-only)."""
        return self.ops.global_norm(self.window_views(), norm_type, backend=self.backend)

    def norm_after_fold(self, fold: FoldNorm) -> torch.Tensor:
        """The norm of the window's sums as they stand, from the last fold's partials and a norm pass over only
        the views that fold did not write (read-only)."""
        rest = [self.views[i] for i in self.sums.indices() if i not in fold.folded]
        return fold.norm(self.ops.global_norm(rest, fold.norm_type, backend=self.backend) if rest else None)

    def unscale_and_norm(
        self, inv_scale: torch.Tensor, found_inf: torch.Tensor, norm_out: torch.Tensor, norm_type: float
    ) -> None:
        """Normalise/unscale what the window holds, flag non-finite values, write the global norm."""
        bufs = self.window_views()
        self.ops.unscale_(bufs, inv_scale, found_inf, backend=self.backend)
        norm_out.copy_(self.ops.global_norm(bufs, norm_type, backend=self.backend).reshape(norm_out.shape))

    def include_all(self) -> None:
        """Every view holds this window's value, zero where none came (distributed sums run over whole buffers)."""
        self.sums.include_all()

    def clip(self, norm: torch.Tensor, max_grad_norm: float | None, clip_value: float | None) -> None:
        bufs = self.window_views()
        if max_grad_norm is not None:
            self.ops.clip_by_norm_(bufs, norm, max_grad_norm, backend=self.backend)
        if clip_value is not None:
            self.ops.clip_by_value_(bufs, clip_value, backend=self.backend)

    def expose(self) -> None:
        """param.grad = this window's gradient (a view, or a param-dtype copy); None if the window gave none."""
        cast = [i for i in self._cast_index if self.sums.written(i)]
        copies = dict(zip(cast, [torch.empty_like(self.layout[i]) for i in cast], strict=True))
        if cast:
            # One fused cast per window into copies that live only until release().
            torch._foreach_copy_([copies[i] for i in cast], [self.views[i] for i in cast])
        for i, p in enumerate(self.params):
            grad = copies[i] if i in copies else self.views[i]
            param_grads.show(p, self._param_grad(i, grad) if self.sums.written(i) else None)

    def _local(self, grad: torch.Tensor) -> torch.Tensor:
        return grad if self.shards is None else self.shards.local_grad(grad)

    def _param_grad(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        return grad if self.shards is None else self.shards.param_grad(i, grad)

    def release(self) -> None:
        """Start a new window: drop param.grad (and the cast copies); the buffers' contents become stale.

        With release=True the flat buffers are freed too and re-created by the next window's first gradient.
        """
        param_grads.clear(self.params)
        self.sums.reset()
        if self.release_after_step:
            self.flats, self.views = {}, []

    # -- checkpointing ----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The window's per-parameter sums (None where none yet): independent of the flat layout."""
        return {"grads": [self.views[i].clone() if self.sums.written(i) else None for i in range(len(self.params))]}

    def load_state_dict(self, state: dict) -> None:
        """Loads state_dict() output, or version 1's {"flats", "seen"} (unpadded, in registration order)."""
        grads = state["grads"] if "grads" in state else self._from_v1(state)
        if len(grads) != len(self.params):
            raise ValueError(
                "GradientAccumulator.load_state_dict: the saved buffers do not match this model's trainable "
                f"parameters (saved {len(grads)} parameters, here {len(self.params)})"
            )
        for i, g in enumerate(grads):
            if g is not None and (g.shape != self.layout[i].shape or g.dtype != self.buf_dtypes[i]):
                raise ValueError(
                    "GradientAccumulator.load_state_dict: the saved buffers do not match this model's trainable "
                    f"parameters (saved gradient {i} is {g.dtype} {list(g.shape)}, expected {self.buf_dtypes[i]} "
                    f"{list(self.layout[i].shape)})"
                )
        self._ensure()
        for view, g in zip(self.views, grads, strict=True):
            if g is not None:
                view.copy_(g)
        self.sums.restore([g is not None for g in grads])

    def _from_v1(self, state: dict) -> list[torch.Tensor | None]:
        flats, seen = state["flats"], state["seen"]
        expected = dict.fromkeys(map(str, self.dtypes), 0)
        for p, dtype in zip(self.layout, self.buf_dtypes, strict=True):
            expected[str(dtype)] += p.numel()
        saved = {k: f.numel() for k, f in flats.items()}
        if saved != expected or len(seen) != len(self.params):
            raise ValueError(
                "GradientAccumulator.load_state_dict: the saved buffers do not match this model's trainable "
                f"parameters (saved {saved} elements per dtype, {len(seen)} parameters; here {expected}, "
                f"{len(self.params)} parameters)"
            )
        offsets = dict.fromkeys(flats, 0)
        grads: list[torch.Tensor | None] = []
        for p, dtype, s in zip(self.layout, self.buf_dtypes, seen, strict=True):
            key, n = str(dtype), p.numel()
            grads.append(flats[key][offsets[key] : offsets[key] + n].view(p.shape) if s else None)
            offsets[key] += n
        return grads


def _dense(grad: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    if grad.layout != torch.strided:
        raise TypeError(
            f"GradientAccumulator: a parameter of shape {list(param.shape)} got a {grad.layout} gradient; "
            "only dense gradients can be accumulated (e.g. use nn.Embedding(sparse=False))"
        )
    # Channels-last parameters get channels-last gradients; the kernels take contiguous ones.
    return grad if grad.is_contiguous() else grad.contiguous()
