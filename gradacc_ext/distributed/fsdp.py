"""FSDP2 (fully_shard) and HSDP: flat buffers over the local shards, one collective for norm and found_inf.

The accumulator's buffers mirror each DTensor parameter's local shard
(uneven shards included, an empty one too), and the optimizer gets
param.grad as a DTensor over a buffer view. FSDP's reductions are made
plain sums (divide factor 1), so the accumulator divides by the window's
item count summed over all ranks, exactly as under DDP.

Accumulation modes (GradientAccumulationConfig.fsdp_reduce):
  "micro_step" (default): every backward reduce-scatters, and the window
    accumulates sharded: gradient memory stays 1/world of the model's
    between micro-steps, and a mid-window checkpoint holds everything (the
    buffers). Costs one reduce-scatter per micro-step.
  "window": set_requires_gradient_sync(False) until the closing micro-step,
    so FSDP accumulates unsharded gradients itself and reduce-scatters once:
    fewer bytes sent, a full unsharded gradient held all window.
HSDP (2-D mesh, replicate x shard): "micro_step" reduce-scatters within the
shard group every micro-step (FSDP keeps the partial sums sharded) and
defers the replicate all-reduce to the window's end with
set_requires_all_reduce(False); "window" defers both.

In every mode but FSDP "micro_step", FSDP holds reduced-but-unfinished
sums between micro-steps that a synced backward releases. flush() of a
short last window releases them itself (release_held: FSDP's end-of-backward
callback with the reductions on); its last micro-batch can close it as well
(`acc.iterate(loader)` marks it, or `acc.micro_step(last=True)`). A
checkpoint must be taken at a window boundary (checked, with a clear error).

"mean" mode with num_items: FSDP reduces each backward's gradient before
the accumulator's hooks see it, so the accumulator multiplies each
micro-batch's loss by its num_items instead (window.weigh_loss): FSDP then
sums item-weighted gradients, and the division by the global item count is
the same as in "sum" mode.

The global norm: each rank's norm over its shards is squared (or kept,
for inf) and one all-reduce over the shard group (SUM, or MAX for inf)
also carries found_inf, so every rank clips by the same coefficient and
skips the same steps.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..ops.norms import norm_from_partial, partial_norm
from .base import GradBuffers, GradHooks, LocalSync
from .rank_state import dense_grads, pack_counts, unpack_counts


class FSDP2Sync(LocalSync):
    reduces = True
    weights_micro_batches = False  # FSDP reduces each micro-step's gradient before the hooks see it
    splits_alone = False  # forward/backward run collectives: a rank splitting alone would desync them
    # Every mode reduces inside the closing backward, before the hooks fold the reduced shards: "micro_step"
    # reduce-scatters each micro-step's gradient, "window" and HSDP's deferred all-reduce release FSDP's own
    # held sums there. The last fold writes final shards, so it gathers the norm on them (fold_norm.py) and
    # global_norm combines the shards' partials. A flush()ed window folds outside a last micro-step: full pass.
    sums_final_at_last_fold = True

    def __init__(self, model: torch.nn.Module, params: Sequence[torch.nn.Parameter], mode: str, hsdp: bool) -> None:
        self.model = model
        self.params = list(params)
        self.mode, self.hsdp = mode, hsdp
        self.name = "hsdp" if hsdp else "fsdp"
        self.mesh = self.params[0].device_mesh
        self.shard_group = self.mesh.get_group(self.mesh.ndim - 1)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # Plain sums: the accumulator divides by the global item count once.
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        self._held = False  # FSDP holds unfinished sums of this window outside param.grad

    # -- micro-steps ------------------------------------------------------------------------------------------------

    def context(self, final: bool) -> contextlib.AbstractContextManager:
        self._check_resharded("micro_step()")
        return contextlib.nullcontext()

    def _check_resharded(self, where: str) -> None:
        """Between micro-steps FSDP2 is idle: its end-of-backward callback ran and every parameter is resharded
        (a DTensor). A backward that raised part-way (an out-of-memory error the caller caught) leaves that
        callback pending and modules it had not finished unsharded or mid-reduction: no later backward or
        window end can be exact, so refuse here, before anything runs (the seam matrix, tests/seams, found a
        retry silently wrong). The pending callback is read from FSDP2's root state (private, as release_held)."""
        root = getattr(self.model, "_get_fsdp_state", None)
        context = getattr(root(), "_state_ctx", None) if root is not None else None
        pending = bool(getattr(context, "post_backward_final_callback_queued", False))
        unsharded = [name for name, p in self.model.named_parameters() if not isinstance(p, DTensor)]
        if pending or unsharded:
            names = ", ".join(unsharded[:3])
            left = f"{len(unsharded)} parameter(s) are still unsharded ({names}), " if unsharded else ""
            raise RuntimeError(
                f"GradientAccumulator.{where}: FSDP2 was left mid-backward by a backward that raised (e.g. an "
                f"out-of-memory error that was caught): {left}its end-of-backward callback never ran, so a retried "
                "micro-step cannot be exact. Nothing was written; restart from the last checkpoint (an error in "
                "forward can be retried)"
            )

    def before_backward(self, final: bool, buffers: GradBuffers) -> bool:
        every_step = self.mode == "micro_step"
        self.model.set_requires_gradient_sync(final or every_step)
        if self.hsdp and every_step:
            self.model.set_requires_all_reduce(final)
        self._held = not final and (self.hsdp or not every_step)
        return True  # FSDP sets the reduced shards as param.grad and runs the folding hooks

    def layout(self, params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
        return [p.to_local() for p in params]

    def local_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        return grad.to_local() if isinstance(grad, DTensor) else grad

    def param_grad(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        param = self.params[index]
        with torch.no_grad():
            return DTensor.from_local(
                grad, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
            )

    # -- window end -------------------------------------------------------------------------------------------------

    def release_held(self, hooks: GradHooks) -> None:
        """Runs what the end of a synced backward runs (FSDP's root post-backward callback) with the reductions
        switched on: "window" mode reduce-scatters the unsharded sums FSDP accumulated, HSDP all-reduces the
        partial shard-group sums (reducing zeros beside them: set_reduce_scatter_unused_params). FSDP sets the
        results as the shards' .grad, whose hooks fold them into the buffers. Every rank's flush() runs the same
        collectives, as every rank's closing backward would. Uses FSDP2's root state (a private method of
        FSDPModule); without it, or where the release needs the zeros that torch 2.11 cannot send, the error of
        before_finish stands."""
        self._check_resharded("flush()")
        root = getattr(self.model, "_get_fsdp_state", None)
        if not self._held or root is None or not self._can_release():
            return
        self.model.set_requires_gradient_sync(True)
        if self.hsdp:
            self.model.set_requires_all_reduce(True)
        zeros = self._sends_zeros()
        if zeros:
            self.model.set_reduce_scatter_unused_params(True)
        hooks.arm(1.0)  # FSDP weighs micro-batches in the loss (weights_micro_batches = False)
        try:
            root()._root_post_backward_final_callback()
            hooks.fold_rest()
        except BaseException:
            hooks.abort()  # disarm; the window end does not run (told_to_peers names a failed peer)
            raise
        finally:
            if zeros:
                self.model.set_reduce_scatter_unused_params(False)
        self._held = False

    def _sends_zeros(self) -> bool:
        """Whether FSDP can reduce zeros for parameters without a gradient (set_reduce_scatter_unused_params:
        in torch 2.13, not in 2.11)."""
        return hasattr(self.model, "set_reduce_scatter_unused_params")

    def _can_release(self) -> bool:
        """Whether flush() can release the held sums. In "window" mode FSDP holds unsharded gradients, which the
        callback reduces as a closing backward would; under HSDP "micro_step" it holds only partial shard-group
        sums, and no parameter has a gradient to carry their all-reduce: without the zeros FSDP would skip it."""
        return self._sends_zeros() or not (self.hsdp and self.mode == "micro_step")

    def before_finish(self) -> None:
        self._check_resharded("window end")
        if self._held:
            raise RuntimeError(
                self._held_message(
                    "close a short window with flush()"
                    + ("" if self._can_release() else " (that needs FSDPModule.set_reduce_scatter_unused_params)"),
                    "let the data's last micro-batch close it: loop with `for batch in acc.iterate(loader):` (it "
                    "knows the last batch ahead; a flush() after the loop is then a no-op), or run the last batch "
                    "in `with acc.micro_step(last=True):`",
                )
            )

    def _held_message(self, what: str, fix: str) -> str:
        return (
            f"GradientAccumulator: cannot {what} here: with {self.name} and fsdp_reduce={self.mode!r}, FSDP still "
            f"holds this window's partly reduced gradients, which only a synced backward releases; {fix}; or use "
            "fully_shard on a 1-D mesh with fsdp_reduce='micro_step'"
        )

    def reduce(self, buffers: GradBuffers, count: torch.Tensor) -> None:
        dist.all_reduce(count)  # the mesh spans the whole world (validated); FSDP already summed the buffers

    def global_norm(self, norm: torch.Tensor, found_inf: torch.Tensor, norm_type: float) -> None:
        inf = math.isinf(norm_type)
        local = partial_norm(norm.reshape(()).to(torch.float64), norm_type)
        both = torch.stack([local, found_inf.reshape(()).to(torch.float64)])  # one collective carries both
        dist.all_reduce(both, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=self.shard_group)
        norm.copy_(norm_from_partial(both[0], norm_type).reshape(norm.shape))
        found_inf.copy_((both[1] > 0).reshape(found_inf.shape))

    # -- checkpoints (torch.distributed.checkpoint) -----------------------------------------------------------------

    def wrap_state(self, state: dict[str, Any], buffers: GradBuffers) -> dict[str, Any]:
        """The window's sums as DTensors sharded like the parameters, per-rank counts as rows."""
        if self._held:
            raise RuntimeError(
                self._held_message(
                    "take a mid-window checkpoint",
                    "checkpoint at a window boundary (after a backward() that returned True, or after the data's "
                    "last micro-batch ran in `with acc.micro_step(last=True):`)",
                )
            )
        grads, seen = dense_grads(state, buffers)
        out = pack_counts(state, self.mesh, buffers.device)
        out["buffers"] = {"grads": {str(i): self.param_grad(i, g) for i, g in enumerate(grads)}, "seen": seen}
        return out

    def unwrap_state(self, state: dict[str, Any], buffers: GradBuffers) -> dict[str, Any]:
        out = unpack_counts(state)
        saved = state["buffers"]
        grads = [self.local_grad(saved["grads"][str(i)]) for i in range(len(buffers.params))]
        out["buffers"] = {"grads": [g if s else None for g, s in zip(grads, saved["seen"], strict=True)]}
        return out
