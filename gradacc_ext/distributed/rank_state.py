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


def per_rank(local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """`local` (any shape) as this rank's row of a [world, numel] DTensor; a view when `local` is contiguous."""
    row = local.reshape(1, -1)
    return DTensor.from_local(
        row, mesh, [Shard(0)] * mesh.ndim, shape=(mesh.size(), row.shape[1]), stride=(row.shape[1], 1)
    )


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
