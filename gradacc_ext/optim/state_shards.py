"""int8 optimizer states of FSDP2/HSDP sharded params: which params can quantize exactly, and their DTensor states.

Blocks of 256 (quant_maps.BLOCK) follow each tensor's GLOBAL element index (row-major). A shard holding global
elements [o, o + n) is block-aligned when o % 256 == 0 and (n % 256 == 0 or o + n == numel): then the kernel's
local blocks (counted from the shard's element 0) are global blocks, and the step on the shards equals one
process's bit for bit. Whether every shard of a param is aligned follows from its global shape, its mesh's shape
and its placements alone (`misalignment`: no communication, the same answer on every rank). A param with an
unaligned shard keeps fp32 states, and `int8_fallback_reason` says why (the optimizer's stats and repr show it).

An aligned param's int8 state is two DTensors (`new_sharded_int8_state`): codes sharded like the param, and scales
of global shape (ceil(numel / 256),), Shard(0) on the param's sharded mesh dims, whose local piece is the rank's
own blocks. torch.distributed.checkpoint saves both and reshards them exactly into any layout that is aligned too.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import torch

from ..ops.quant_maps import BLOCK, map_name
from .shards import is_sharded

Interval = tuple[int, int]  # (start, length)


def _chunk(interval: Interval, parts: int, index: int) -> Interval:
    """Piece `index` of `interval` split into `parts` as torch.chunk (and DTensor's Shard) split it: pieces of
    ceil(length / parts), the trailing ones shorter or empty."""
    start, length = interval
    size = -(-length // parts)
    begin = min(index * size, length)
    return start + begin, min(size, length - begin)


def _is_dim0_shard(placement: Any) -> bool:
    # _StridedShard (FSDP2 x TP) subclasses Shard but interleaves its pieces: not a contiguous element range.
    return type(placement).__name__ == "Shard" and placement.dim == 0


def _placement_error(ndim: int, placements: tuple[Any, ...]) -> str | None:
    if ndim == 0:
        return "it is a 0-dim tensor (FSDP2 shards dim 0)"
    for placement in placements:
        if not (_is_dim0_shard(placement) or placement.is_replicate()):
            return f"its placement {placement} is not Shard(0) or Replicate(): its shards are not element ranges"
    return None


@functools.cache
def misalignment(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Any, ...]) -> str | None:
    """Why some shard of a tensor of global `shape`, laid out by `placements` on a mesh of `mesh_shape`, is not
    block-aligned (or its blocks do not split as torch.chunk splits the scales), or None when all are aligned."""
    why = _placement_error(len(shape), placements)
    if why is not None:
        return why
    rows, numel = shape[0], math.prod(shape)
    row_numel, blocks = math.prod(shape[1:]), -(-numel // BLOCK)
    for coord in itertools.product(*(range(size) for size in mesh_shape)):
        part, block_part = (0, rows), (0, blocks)
        for placement, size, index in zip(placements, mesh_shape, coord, strict=True):
            if _is_dim0_shard(placement):
                part, block_part = _chunk(part, size, index), _chunk(block_part, size, index)
        first, n = part[0] * row_numel, part[1] * row_numel
        if n and (first % BLOCK or (n % BLOCK and first + n != numel)):
            return (
                f"its shard at mesh coordinate {coord} holds elements [{first}, {first + n}) of {numel}, which "
                f"start or end inside a {BLOCK}-element block"
            )
        own = (first // BLOCK, -(-n // BLOCK)) if n else (block_part[0], 0)
        if own[1] != block_part[1] or (n and own[0] != block_part[0]):
            return (
                f"its shard at mesh coordinate {coord} holds blocks {own}, but its {blocks} scales split as "
                f"{block_part} (start, count)"
            )
    return None


def int8_fallback_reason(param: torch.Tensor) -> str | None:
    """Why `param` (an FSDP2/HSDP DTensor) cannot hold exact int8 states, or None (a plain tensor is one whole
    shard: always aligned)."""
    if not is_sharded(param):
        return None
    return misalignment(tuple(param.shape), tuple(param.device_mesh.shape), tuple(param.placements))


def scales_placements(placements: tuple[Any, ...]) -> tuple[Any, ...]:
    """The scales' placements: Shard(0) where the param is sharded (on dim 0), Replicate where it is replicated."""
    from torch.distributed.tensor import Replicate, Shard

    return tuple(Shard(0) if _is_dim0_shard(p) else Replicate() for p in placements)


def new_sharded_int8_state(param: torch.Tensor, key: str, signed: bool, scales_key: str, map_key: str) -> dict:
    """A fresh int8 state `key` of an aligned DTensor `param`: zero codes sharded like it, zero scales as a DTensor
    of global shape (ceil(numel / 256),) whose local piece covers this rank's blocks, and the code book's name."""
    from torch.distributed.tensor import DTensor

    why = int8_fallback_reason(param)
    if why is not None:
        raise ValueError(f"int8 state {key!r} of a sharded param of shape {list(param.shape)}: {why}")
    codes = torch.zeros_like(param, dtype=torch.uint8, memory_format=torch.contiguous_format)
    local = param.to_local()
    mine = torch.zeros(-(-local.numel() // BLOCK), dtype=torch.float32, device=local.device)
    blocks = -(-param.numel() // BLOCK)
    placements = scales_placements(tuple(param.placements))
    scales = DTensor.from_local(mine, param.device_mesh, placements, run_check=False, shape=(blocks,), stride=(1,))
    return {key: codes, scales_key: scales, map_key: map_name(signed)}
