"""Per-rank checkpoint values as DTensors sharded one row per rank, for torch.distributed.checkpoint.

DCP keeps ONE copy of a plain tensor or Python value that every rank saves
under the same key (it assumes replication), but a window's item count, and
DDP's not-yet-reduced buffers, differ by rank. Stacking them as rows of a
DTensor sharded over all ranks makes DCP save and load each rank's own row.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .base import GradBuffers


def per_rank(local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """`local` (any shape) as this rank's row of a [world, numel] DTensor; a view when `local` is contiguous."""
    row = local.reshape(1, -1)
    return DTensor.from_local(
        row, mesh, [Shard(0)] * mesh.ndim, shape=(mesh.size(), row.shape[1]), stride=(row.shape[1], 1)
    )


def dense_grads(state: dict[str, Any], buffers: GradBuffers) -> tuple[list[torch.Tensor], list[bool]]:
    """The window's per-parameter sums from state["buffers"], zeros (and seen=False) where none yet.

    Every parameter gets a tensor so that a fresh accumulator's state_dict() has
    the same keys as a saved one, which DCP loads into.
    """
    saved = state["buffers"]["grads"]
    grads = [
        g if g is not None else torch.zeros(t.shape, dtype=d, device=buffers.device)
        for g, t, d in zip(saved, buffers.layout, buffers.buf_dtypes, strict=True)
    ]
    return grads, [g is not None for g in saved]


def pack_counts(state: dict[str, Any], mesh: DeviceMesh, device: torch.device) -> dict[str, Any]:
    """Moves count_host/count_dev (this rank's window normaliser) into one per-rank 'counts' DTensor."""
    dev = state["count_dev"]
    local = torch.tensor(
        [state["count_host"], 0.0 if dev is None else float(dev.sum()), float(dev is not None)],
        dtype=torch.float64,
        device=device,
    )
    return {**state, "count_host": None, "count_dev": None, "counts": per_rank(local, mesh)}


def unpack_counts(state: dict[str, Any]) -> dict[str, Any]:
    if "counts" not in state:
        raise ValueError(
            "GradientAccumulator.load_state_dict: this state has no per-rank 'counts'; it was not saved by a "
            "distributed accumulator's state_dict(): load the state of a run with the same data parallelism"
        )
    out = dict(state)
    host, dev, has_dev = out.pop("counts").to_local().reshape(3).tolist()
    out["count_host"] = host
    out["count_dev"] = torch.tensor([dev], dtype=torch.float64) if has_dev else None
    return out
