"""The accumulator's own gradient buffers: one flat buffer per buffer dtype, per-parameter views.

Each micro-step adds the fresh param.grad tensors into the views and the
caller then drops param.grad, so autograd writes a new gradient next time
and no zeroing pass is ever needed: the first contribution of a window is
written with assign=True. A parameter that gets no gradient in a micro-step
contributes nothing to it; one that gets none in the whole window is shown
to the optimizer with grad None, as in a plain loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace

import torch

from .. import ops
from ..ops import reference

LOW_PRECISION = (torch.float16, torch.bfloat16)


def _reference_ops() -> SimpleNamespace:
    """The op calls for float64 buffers, which the kernels (and ops' checks) do not take.

    gradacc_ext.reference implements every op in the tensors' own precision, so
    float64 models accumulate, normalise and clip in float64.
    """

    def accumulate_(bufs, grads, scale=1.0, *, assign=False, backend=None):
        alpha, tensor = (1.0, scale) if isinstance(scale, torch.Tensor) else (float(scale), None)
        reference.accumulate_(bufs, grads, alpha, tensor, assign)

    def accumulate_final_(
        bufs, grads, found_inf, norm_out, scale=1.0, *, inv_scale=None, assign=False, norm_type=2.0, backend=None
    ):
        alpha, tensor = (1.0, scale) if isinstance(scale, torch.Tensor) else (float(scale), None)
        reference.accumulate_final_(bufs, grads, alpha, tensor, assign, inv_scale, found_inf, norm_out, norm_type)

    def unscale_(tensors, inv_scale, found_inf, *, backend=None):
        reference.unscale_(tensors, inv_scale, found_inf)

    def global_norm(tensors, norm_type=2.0, *, backend=None):
        return reference.global_norm(tensors, norm_type, False)[0]

    def clip_by_norm_(tensors, total_norm, max_norm, *, backend=None):
        reference.clip_by_norm_(tensors, total_norm, max_norm, ops.DEFAULT_EPS)

    def clip_by_value_(tensors, clip_value, *, backend=None):
        reference.clip_by_value_(tensors, clip_value)

    return SimpleNamespace(
        accumulate_=accumulate_,
        accumulate_final_=accumulate_final_,
        unscale_=unscale_,
        global_norm=global_norm,
        clip_by_norm_=clip_by_norm_,
        clip_by_value_=clip_by_value_,
    )


class GradBuffers:
    """Flat accumulation buffers for `params` (trainable, on one device).

    layout: per parameter, the tensor whose shape the buffer mirrors (FSDP2: the
    local shard; default: the parameter); grad_for(i, tensor) makes what the
    optimizer sees as params[i].grad (FSDP2: a DTensor over the view).
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        accum_dtype: torch.dtype | None,
        backend: str,
        layout: Sequence[torch.Tensor] | None = None,
        grad_for: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.params = list(params)
        self.backend = backend
        if layout is None and any(type(p).__name__ == "DTensor" for p in self.params):
            # Local-shard shapes and a cross-shard norm come from gradacc_ext.distributed's FSDP2 strategy.
            raise TypeError(
                "GradientAccumulator: DTensor (FSDP2 fully_shard) parameters need the fully_shard-ed model passed "
                "to the accumulator (it lays the buffers over the local shards)"
            )
        self.layout = list(layout) if layout is not None else self.params
        self.grad_for = grad_for or (lambda i, grad: grad)
        devices = {t.device for t in self.layout}
        if len(devices) > 1:
            raise ValueError(
                "GradientAccumulator: all trainable parameters must be on one device, "
                f"found {sorted(map(str, devices))}"
            )
        self.device = devices.pop() if devices else torch.device("cpu")
        buf_dtypes = [
            accum_dtype if (accum_dtype is not None and t.dtype in LOW_PRECISION) else t.dtype for t in self.layout
        ]
        self.flats: dict[torch.dtype, torch.Tensor] = {}
        self.views: list[torch.Tensor] = [torch.empty(0)] * len(self.params)
        for dtype in dict.fromkeys(buf_dtypes):
            members = [i for i, d in enumerate(buf_dtypes) if d == dtype]
            flat = torch.empty(sum(self.layout[i].numel() for i in members), dtype=dtype, device=self.device)
            offset = 0
            for i in members:
                n = self.layout[i].numel()
                self.views[i] = flat[offset : offset + n].view(self.layout[i].shape)
                offset += n
            self.flats[dtype] = flat
        # Parameters whose buffer dtype differs from their own get their gradient
        # cast into this param-dtype copy once per window (optimizers require
        # grad.dtype == param.dtype); allocated on the first window end.
        self._cast_index = [i for i, d in enumerate(buf_dtypes) if d != self.params[i].dtype]
        self._cast_views: list[torch.Tensor] | None = None
        self.ops = _reference_ops() if torch.float64 in self.flats else ops
        self.seen = [False] * len(self.params)

    # -- per micro-step ---------------------------------------------------------------------------------------------

    def add(self, grads: Sequence[torch.Tensor | None], scale: float | torch.Tensor) -> None:
        """views += scale * grads; a parameter's first gradient of the window is assigned instead."""
        first = [i for i, g in enumerate(grads) if g is not None and not self.seen[i]]
        again = [i for i, g in enumerate(grads) if g is not None and self.seen[i]]
        for index, assign in ((first, True), (again, False)):
            if index:
                self.ops.accumulate_(
                    [self.views[i] for i in index],
                    [_dense(grads[i], self.params[i]) for i in index],
                    scale,
                    assign=assign,
                    backend=self.backend,
                )
        for i in first:
            self.seen[i] = True

    def add_final(
        self,
        grads: Sequence[torch.Tensor | None],
        scale: float | torch.Tensor,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        norm_out: torch.Tensor,
        norm_type: float,
    ) -> None:
        """The last micro-step: accumulate, multiply by inv_scale, flag non-finite values and take the norm.

        One fused pass when this step's gradients cover exactly the parameters
        already in the window (or the window is this step alone); otherwise
        an accumulate pass and then the finishing pass.
        """
        present = [g is not None for g in grads]
        if present == self.seen or not any(self.seen):
            index = [i for i, p in enumerate(present) if p]
            self.ops.accumulate_final_(
                [self.views[i] for i in index],
                [_dense(grads[i], self.params[i]) for i in index],
                found_inf,
                norm_out,
                scale,
                inv_scale=inv_scale,
                assign=not any(self.seen),
                norm_type=norm_type,
                backend=self.backend,
            )
            for i in index:
                self.seen[i] = True
            return
        self.add(grads, scale)
        self.finish(inv_scale, found_inf, norm_out, norm_type)

    def finish(
        self, inv_scale: torch.Tensor, found_inf: torch.Tensor, norm_out: torch.Tensor, norm_type: float
    ) -> None:
        """Normalise/unscale what the window holds, flag non-finite values, write the global norm."""
        bufs = self.window_views()
        self.ops.unscale_(bufs, inv_scale, found_inf, backend=self.backend)
        norm_out.copy_(self.ops.global_norm(bufs, norm_type, backend=self.backend).reshape(norm_out.shape))

    # -- window end -------------------------------------------------------------------------------------------------

    def window_views(self) -> list[torch.Tensor]:
        return [v for v, s in zip(self.views, self.seen, strict=True) if s]

    def include_all(self) -> None:
        """Zero the views of parameters without a gradient this window and count them in.

        Distributed sums run over the whole flat buffers, so every view must hold
        this window's value (zero when this rank produced no gradient for it).
        """
        for i, seen in enumerate(self.seen):
            if not seen:
                self.views[i].zero_()
                self.seen[i] = True

    def clip(self, norm: torch.Tensor, max_grad_norm: float | None, clip_value: float | None) -> None:
        bufs = self.window_views()
        if max_grad_norm is not None:
            self.ops.clip_by_norm_(bufs, norm, max_grad_norm, backend=self.backend)
        if clip_value is not None:
            self.ops.clip_by_value_(bufs, clip_value, backend=self.backend)

    def expose(self) -> None:
        """param.grad = this window's gradient (a view, or a param-dtype copy); None if the window gave none."""
        if self._cast_index and self._cast_views is None:
            self._cast_views = [torch.empty_like(self.layout[i]) for i in self._cast_index]
        if self._cast_index:
            # One fused cast per window; optimizers need grads in the parameter's dtype.
            torch._foreach_copy_(self._cast_views, [self.views[i] for i in self._cast_index])
            cast = dict(zip(self._cast_index, self._cast_views, strict=True))
        else:
            cast = {}
        for i, p in enumerate(self.params):
            p.grad = self.grad_for(i, cast[i] if i in cast else self.views[i]) if self.seen[i] else None

    def release(self) -> None:
        """Start a new window: the buffers' contents become stale (the next add assigns)."""
        for p in self.params:
            p.grad = None
        self.seen = [False] * len(self.params)

    # -- checkpointing ----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"flats": {str(d): f.clone() for d, f in self.flats.items()}, "seen": list(self.seen)}

    def load_state_dict(self, state: dict) -> None:
        flats, seen = state["flats"], state["seen"]
        if sorted(flats) != sorted(str(d) for d in self.flats) or len(seen) != len(self.params):
            raise ValueError(
                "GradientAccumulator.load_state_dict: the saved buffers do not match this model's trainable "
                f"parameters (saved dtypes {sorted(flats)}, {len(seen)} parameters; here "
                f"{sorted(str(d) for d in self.flats)}, {len(self.params)} parameters)"
            )
        for dtype, flat in self.flats.items():
            saved = flats[str(dtype)]
            if saved.shape != flat.shape:
                raise ValueError(
                    f"GradientAccumulator.load_state_dict: saved {dtype} buffer has {saved.numel()} elements, "
                    f"expected {flat.numel()}"
                )
        for dtype, flat in self.flats.items():
            flat.copy_(flats[str(dtype)])
        self.seen = [bool(s) for s in seen]


def _dense(grad: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    if grad.layout != torch.strided:
        raise TypeError(
            f"GradientAccumulator: a parameter of shape {list(param.shape)} got a {grad.layout} gradient; "
            "only dense gradients can be accumulated (e.g. use nn.Embedding(sparse=False))"
        )
    # Channels-last parameters get channels-last gradients; the kernels take contiguous ones.
    return grad if grad.is_contiguous() else grad.contiguous()
