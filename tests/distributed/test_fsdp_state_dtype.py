"""state_dtype over FSDP2 sharded params (2 gloo ranks): "bf16" states step on the local shards and stay DTensors
sharded like their params; "int8" on params whose shards split inside a 256-element block (all of this small
model's) keeps fp32 states, the repr saying why (aligned shards: tests/distributed/test_fsdp_lowbit.py)."""

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
    int8.step()
    for p in model.parameters():
        state = int8.state[p]["exp_avg"]
        assert isinstance(state, DTensor) and state.dtype == torch.float32 and "exp_avg_scales" not in int8.state[p]
    assert repr(int8).count("fp32 states, its shard at mesh coordinate") == len(before)
    with torch.no_grad():  # back to the params before, for the bf16 step's check
        for p, b in zip(model.parameters(), before, strict=True):
            p.to_local().copy_(b)

    bf16 = FusedAdamW(model.parameters(), lr=0.1, state_dtype="bf16")
    bf16.step()
    for p, b in zip(model.parameters(), before, strict=True):
        state = bf16.state[p]["exp_avg_sq"]
        assert isinstance(state, DTensor) and state.dtype == torch.bfloat16 and state.placements == p.placements
        assert not torch.equal(p.to_local(), b) or p.to_local().numel() == 0


def test_fsdp2_bf16_states_step_on_shards_and_unaligned_int8_keeps_fp32():
    launch(_worker, 2, timeout=120)
