"""How a window's micro-steps interact with data-parallel wrappers.

DDP: every micro-step (forward and backward) runs under model.no_sync(), so
DDP never reduces; at the window end the accumulator all-reduces its whole
flat buffers (SUM) and the window's item count once, then divides by the
global count: what gets all-reduced is the whole accumulated gradient, in
the buffers' precision (fp32 for bf16 parameters).

FSDP2 (fully_shard): set_requires_gradient_sync(False) on non-final
micro-steps, True on the final one, so FSDP reduce-scatters the whole
accumulated gradient once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:  # the accumulator passes its buffers in; no runtime import back into accumulate/
    from ..accumulate.buffers import GradBuffers


class LocalSync:
    """A single process, or parameters without a data-parallel wrapper."""

    needs_context = False  # forward and backward must run inside micro_step()
    reduces = False  # the accumulator sums buffers and counts across ranks itself

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        yield

    def before_backward(self, final: bool) -> None:
        """Called right before each micro-step's backward."""

    def reduce(self, buffers: GradBuffers, count: torch.Tensor) -> None:
        """Sums the window's buffers and item count over ranks (in place)."""


class DDPSync(LocalSync):
    needs_context = True
    reduces = True

    def __init__(self, model: DistributedDataParallel) -> None:
        self.model = model
        self.group = model.process_group

    def context(self):
        return self.model.no_sync()

    def reduce(self, buffers: GradBuffers, count: torch.Tensor) -> None:
        buffers.include_all()
        for flat in buffers.flats.values():
            dist.all_reduce(flat, group=self.group)
        dist.all_reduce(count, group=self.group)


class FSDP2Sync(LocalSync):
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def before_backward(self, final: bool) -> None:
        self.model.set_requires_gradient_sync(final)


def grad_sync_for(module: torch.nn.Module | None) -> LocalSync:
    if isinstance(module, DistributedDataParallel):
        return DDPSync(module)
    if module is not None and callable(getattr(module, "set_requires_gradient_sync", None)):
        return FSDP2Sync(module)
    return LocalSync()
