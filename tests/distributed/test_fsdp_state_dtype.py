"""state_dtype over FSDP2 sharded params (2 gloo ranks): "bf16" states step on the local shards and stay DTensors
sharded like their params; "int8" is refused at the first step, before any param or state is written (the
scales of a shard are not defined yet)."""

from __future__ import annotations

import pytest
import torch
from _dist import fsdp_model, launch, needs_gloo
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from gradacc_ext.optim import FusedAdamW

pytestmark = [pytest.mark.distributed, needs_gloo]


def _worker(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    model = fsdp_model(mesh, dtype=torch.float32)
    x, y = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank)), torch.randn(4, 3)
    torch.nn.functional.mse_loss(model(x), y).backward()

    before = [p.to_local().clone() for p in model.parameters()]
    int8 = FusedAdamW(model.parameters(), lr=0.1, state_dtype="int8", int8_min_numel=0)
    with pytest.raises(ValueError, match="state_dtype='int8' is not supported for FSDP2 sharded"):
        int8.step()
    assert all(torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before, strict=True))

    bf16 = FusedAdamW(model.parameters(), lr=0.1, state_dtype="bf16")
    bf16.step()
    for p, b in zip(model.parameters(), before, strict=True):
        state = bf16.state[p]["exp_avg_sq"]
        assert isinstance(state, DTensor) and state.dtype == torch.bfloat16 and state.placements == p.placements
        assert not torch.equal(p.to_local(), b) or p.to_local().numel() == 0


def test_fsdp2_bf16_states_step_on_shards_and_int8_is_refused():
    launch(_worker, 2, timeout=120)
