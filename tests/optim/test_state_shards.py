"""state_shards.misalignment, the block rule of int8 states on FSDP2/HSDP shards, against a brute-force oracle.

The oracle splits the global element indices as DTensor does (torch.chunk along dim 0, once per sharded mesh
dim) and calls a shard aligned when every block it touches lies wholly inside it and its blocks are the ones
torch.chunk gives it of the scales (the distributed tests check the same rule on real DTensors).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from gradacc_ext.ops.quant_maps import BLOCK
from gradacc_ext.optim.state_shards import misalignment, scales_placements

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")


def _piece(t: torch.Tensor, placements, mesh_shape, coord, dim: int = 0) -> torch.Tensor:
    for placement, size, index in zip(placements, mesh_shape, coord, strict=True):
        if isinstance(placement, Shard):
            chunks = t.chunk(size, dim)
            t = chunks[index] if index < len(chunks) else t.narrow(dim, 0, 0)
    return t


def _aligned_by_oracle(shape, mesh_shape, placements) -> bool:
    numel = math.prod(shape)
    index = torch.arange(numel).reshape(shape)
    blocks = torch.arange(-(-numel // BLOCK))
    for coord in itertools.product(*(range(s) for s in mesh_shape)):
        mine = set(_piece(index, placements, mesh_shape, coord).flatten().tolist())
        touched = sorted({i // BLOCK for i in mine})
        if any(not set(range(b * BLOCK, min((b + 1) * BLOCK, numel))) <= mine for b in touched):
            return False
        if touched != _piece(blocks, scales_placements(placements), mesh_shape, coord).tolist():
            return False
    return True


MESHES = [((1,), (Shard(0),)), ((2,), (Shard(0),)), ((3,), (Shard(0),)), ((4,), (Shard(0),))]
MESHES += [((2, 2), (Replicate(), Shard(0))), ((2, 3), (Shard(0), Shard(0))), ((2,), (Replicate(),))]


@pytest.mark.parametrize(("mesh_shape", "placements"), MESHES)
def test_block_rule_matches_the_oracle(mesh_shape, placements):
    results = []
    for rows, row_numel in itertools.product((1, 2, 3, 5, 7, 8, 13), (1, 3, 64, 100, 128, 256, 384)):
        shape = (rows, row_numel) if row_numel > 1 else (rows,)
        aligned = misalignment(shape, mesh_shape, placements) is None
        assert aligned == _aligned_by_oracle(shape, mesh_shape, placements), (shape, mesh_shape, placements)
        results.append(aligned)
    if math.prod(s for s, p in zip(mesh_shape, placements, strict=True) if isinstance(p, Shard)) > 1:
        assert any(results) and not all(results)  # the sample holds both kinds


def test_even_splits_of_whole_blocks_are_aligned_uneven_ones_not():
    """Aligned: dim 0 splits evenly and a shard holds whole blocks. An uneven split of rows of 512 holds whole
    blocks too, but a DTensor of the scales would not split them as the param's shards do: fp32 states."""
    for shards, rows_each, row_numel in itertools.product((2, 3, 4), (1, 2, 3), (64, 128, 256, 512)):
        if rows_each * row_numel % BLOCK == 0:
            assert misalignment((shards * rows_each, row_numel), (shards,), (Shard(0),)) is None
    why = misalignment((3, 512), (2,), (Shard(0),))
    assert why is not None and "holds blocks (0, 4)" in why and "6 scales split as (0, 3)" in why


def test_reasons_name_the_shard_or_the_placement():
    why = misalignment((3, 100), (2,), (Shard(0),))
    assert why is not None and "mesh coordinate (0,)" in why and "[0, 200) of 300" in why
    why = misalignment((4, 256), (2,), (Shard(1),))
    assert why is not None and "S(1)" in why
