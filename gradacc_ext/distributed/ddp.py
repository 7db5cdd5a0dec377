"""DistributedDataParallel: whole-buffer reduce at the window end, or DDP's own overlapped reducer.

"buffer" (DDPSync): every micro-step runs under model.no_sync(); at the
window end the accumulator's flat buffers and the item count are
all-reduced (SUM) once, after the last backward: nothing overlaps.

"overlap" (DDPOverlapSync): non-final micro-steps run under no_sync and
accumulate into the flat buffers as usual. The final micro-step runs
outside no_sync with param.grad set to the buffer views, so autograd adds
the last gradient into the running sum in place and DDP's reducer
all-reduces the whole window's sum bucket by bucket while the rest of
the backward still runs (its bucketed, overlapped all-reduce), then
copies the result back into the views. A comm hook makes the reduction a
plain SUM (the accumulator divides by the global item count) and can
communicate in bf16 while the buffers stay fp32. A short window closed
by flush() had no synced backward and falls back to the buffer reduce.

Either way the count is all-reduced too, so uneven per-rank num_items
give the exact global mean. In "overlap" mode, "mean" mode's per-micro-batch
num_items weights go into each loss (window.weigh_loss), since the reducer
sums the closing gradient before any hook could weight it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from .base import GradBuffers, GradHooks, LocalSync
from .rank_state import dense_grads, pack_counts, per_rank, unpack_counts


def all_reduce_sum(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, comm_dtype: torch.dtype | None, chunk: int
) -> None:
    """tensor = its SUM over the group, sent in comm_dtype when given (then rounded once on the way).

    The comm_dtype copy is made `chunk` elements at a time into one reused
    buffer: a copy of the whole flat buffer would be a temporary of half the
    window's gradient (bf16) beside it, more than the plain loop ever holds.
    """
    if comm_dtype is None or comm_dtype == tensor.dtype:
        dist.all_reduce(tensor, group=group)
        return
    low = torch.empty(min(chunk, tensor.numel()), dtype=comm_dtype, device=tensor.device)
    for part in tensor.split(chunk):
        piece = low[: part.numel()]
        piece.copy_(part)
        dist.all_reduce(piece, group=group)
        part.copy_(piece)


class DDPSync(LocalSync):
    needs_context = True
    reduces = True
    sums_final_at_last_fold = False  # the window end all-reduces the sums after the last fold (overlap: no fold)
    name = "ddp"

    def __init__(self, model: DistributedDataParallel, comm_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.group = model.process_group
        self.comm_dtype = comm_dtype

    def context(self, final: bool) -> contextlib.AbstractContextManager:
        return self.model.no_sync()

    def reduce(self, buffers: GradBuffers, count: torch.Tensor) -> None:
        buffers.include_all()
        # Chunks of the largest gradient: the temporary stays below what the plain loop holds in flight
        # while autograd adds that gradient into .grad.
        chunk = max([1, *(t.numel() for t in buffers.layout)])
        for flat in buffers.flats.values():
            all_reduce_sum(flat, self.group, self.comm_dtype, chunk)
        dist.all_reduce(count, group=self.group)

    def wrap_state(self, state: dict[str, Any], buffers: GradBuffers) -> dict[str, Any]:
        """Each rank's unreduced sums, seen flags and counts as its row of a DTensor (DCP keeps every rank's)."""
        mesh = DeviceMesh.from_group(self.group, buffers.device.type)
        grads, seen = dense_grads(state, buffers)
        out = pack_counts(state, mesh, buffers.device)
        out["buffers"] = {
            "grads": {str(i): per_rank(g, mesh) for i, g in enumerate(grads)},
            "seen": per_rank(torch.tensor(seen, dtype=torch.float64, device=buffers.device), mesh),
        }
        return out

    def unwrap_state(self, state: dict[str, Any], buffers: GradBuffers) -> dict[str, Any]:
        out = unpack_counts(state)
        saved = state["buffers"]
        seen = [bool(s) for s in saved["seen"].to_local().reshape(-1).tolist()]
        grads = [saved["grads"][str(i)].to_local().reshape(t.shape) for i, t in enumerate(buffers.layout)]
        out["buffers"] = {"grads": [g if s else None for g, s in zip(grads, seen, strict=True)]}
        return out


def _sum_hook(sync, bucket):  # unannotated: DDP checks the annotations, which `from __future__` makes strings
    """DDP comm hook (DDPOverlapSync, dist.GradBucket) -> Future[Tensor]: SUM, no division by the world size."""
    buffer = bucket.buffer()
    if sync.comm_dtype is None or sync.comm_dtype == buffer.dtype:
        return dist.all_reduce(buffer, group=sync.group, async_op=True).get_future().then(lambda f: f.value()[0])
    low = buffer.to(sync.comm_dtype)

    def back(fut: torch.futures.Future) -> torch.Tensor:
        return buffer.copy_(fut.value()[0])

    return dist.all_reduce(low, group=sync.group, async_op=True).get_future().then(back)


class DDPOverlapSync(DDPSync):
    weights_micro_batches = False  # the closing micro-step's gradient is reduced as autograd produces it
    splits_alone = False  # forward/backward run collectives: a rank splitting alone would desync them
    name = "ddp-overlap"

    def __init__(self, model: DistributedDataParallel, comm_dtype: torch.dtype | None = None) -> None:
        super().__init__(model, comm_dtype)
        model.register_comm_hook(self, _sum_hook)
        self._synced = False  # the open micro-step runs outside no_sync
        self._closing_backward = False  # a closing backward began and its window end has not reduced yet

    def context(self, final: bool) -> contextlib.AbstractContextManager:
        self._refuse_after_failed_close("micro_step()")
        self._synced = final
        return contextlib.nullcontext() if final else self.model.no_sync()

    def release_held(self, hooks: GradHooks) -> None:
        self._refuse_after_failed_close("flush()")  # flush() only: a closing micro-step reduces on its own

    def _refuse_after_failed_close(self, where: str) -> None:
        """A closing backward that raised part-way (an out-of-memory error the caller caught) left DDP's reducer
        mid-reduction, and autograd had already added part of it into the window's sums in place (they are
        param.grad): no retry or flush can be exact, so refuse before anything runs (the seam matrix,
        tests/seams, found the retry failing with DDP's misleading 'unused parameters' error)."""
        if self._closing_backward:
            raise RuntimeError(
                f"GradientAccumulator.{where}: with ddp_reduce='overlap' the window's closing backward raised "
                "part-way (e.g. an out-of-memory error that was caught): DDP's reducer is mid-reduction and the "
                "window's sums hold part of that backward, so no retry can be exact. Nothing was written; restart "
                "from the last checkpoint (ddp_reduce='buffer' reduces nothing inside a micro-step)"
            )

    def before_backward(self, final: bool, buffers: GradBuffers) -> bool:
        if self._synced != final:
            raise RuntimeError(
                "GradientAccumulator: ddp_reduce='overlap' needs exactly one backward per micro_step() (DDP reduces "
                "during the closing one); split micro-batches (AdaptiveGradientAccumulator) need ddp_reduce='buffer'"
            )
        if not final:
            return True
        self._closing_backward = True
        # The running sum becomes param.grad: autograd accumulates into it in place, DDP reduces it.
        buffers.include_all()
        for param, view in zip(buffers.params, buffers.views, strict=True):
            param.grad = view
        return False

    def reduce(self, buffers: GradBuffers, count: torch.Tensor) -> None:
        if self._synced:  # DDP's reducer already summed the buffers during the backward
            self._synced = self._closing_backward = False
            dist.all_reduce(count, group=self.group)
            return
        super().reduce(buffers, count)
