"""Low-bit optimizer states (state_dtype "int8" / "bf16") under FSDP2 and HSDP, and their DCP checkpoints.

Every rank trains on the same batches, so FSDP2's averaged grads are one process's exactly and the runs can be
compared bit for bit: on block-aligned params the int8 step on the shards equals one process's (params, codes,
scales); unaligned params keep fp32 states (one process with those params in an fp32 group is the reference).
"""

from __future__ import annotations

import pytest
import torch
from _dist import launch, needs_gloo
from _lowbit_dist import (
    ALIGNED_ON_2,
    OPTIMIZERS,
    aligned_model,
    assert_same_run,
    batches,
    dcp_load,
    dcp_save,
    make_opt,
    mixed_model,
    sharded,
    split_groups,
    train,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from gradacc_ext.ops.quant_maps import BLOCK
from gradacc_ext.optim.state_shards import int8_fallback_reason

pytestmark = [pytest.mark.distributed, needs_gloo]
STEPS = 4


def check_int8_equals_one_process(mesh, aligned: tuple[str, ...]) -> None:
    data = batches(STEPS, seed=11)
    for name in OPTIMIZERS:
        model = sharded(mixed_model(), mesh)
        opt = make_opt(name, model.parameters())
        train(model, opt, data)
        ref = mixed_model()
        ref_opt = make_opt(name, split_groups(ref, aligned))
        train(ref, ref_opt, data)
        assert_same_run(model, opt, ref, ref_opt)
        for pname, p in model.named_parameters():
            key = next(k for k in opt.state[p] if k != "step")
            state = opt.state[p][key]
            assert isinstance(state, DTensor) and state.placements == p.placements, (name, pname)
            if pname in aligned:  # codes sharded like the param, scales over the global blocks
                scales = opt.state[p][key + "_scales"]
                assert state.dtype == torch.uint8 and isinstance(scales, DTensor), (name, pname)
                assert scales.shape == (-(-p.numel() // BLOCK),) and Shard(0) in scales.placements
                assert scales.to_local().numel() == -(-p.to_local().numel() // BLOCK)
            else:
                assert state.dtype == torch.float32 and key + "_scales" not in opt.state[p], (name, pname)


def check_resume(mesh, ckpt: str) -> None:
    """DCP save after 2 steps, load into fresh objects, 2 more steps: the uninterrupted run, bit for bit."""
    data = batches(STEPS, seed=13)
    for name, state_dtype in (("adamw", "int8"), ("sgd", "int8"), ("adamw", "bf16")):
        model = sharded(mixed_model(), mesh)
        opt = make_opt(name, model.parameters(), state_dtype)
        train(model, opt, data[:2])
        dcp_save(model, opt, f"{ckpt}-{name}-{state_dtype}")
        train(model, opt, data[2:])
        resumed = sharded(mixed_model(seed=5), mesh)
        resumed_opt = make_opt(name, resumed.parameters(), state_dtype)
        dcp_load(resumed, resumed_opt, f"{ckpt}-{name}-{state_dtype}")
        train(resumed, resumed_opt, data[2:])
        assert_same_run(resumed, resumed_opt, model, opt)


def fsdp_worker(rank: int, world: int, ckpt: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    model = sharded(mixed_model(), mesh)
    aligned = {n for n, p in model.named_parameters() if int8_fallback_reason(p) is None}
    assert aligned == set(ALIGNED_ON_2)
    check_int8_equals_one_process(mesh, ALIGNED_ON_2)
    check_resume(mesh, ckpt)
    # for the world-size-1 load: every param aligned, saved after 2 steps
    model = sharded(aligned_model(), mesh)
    opt = make_opt("adamw", model.parameters())
    train(model, opt, batches(2, seed=17, out=1024))
    dcp_save(model, opt, ckpt + "-aligned")


def test_int8_states_on_two_fsdp2_ranks_equal_one_process_and_resume(tmp_path):
    launch(fsdp_worker, 2, str(tmp_path / "ckpt"), timeout=240)
    # saved on 2 ranks, loaded by one process (no process group): aligned both ways, so exact
    data = batches(STEPS, seed=17, out=1024)
    model = aligned_model()
    opt = make_opt("adamw", model.parameters())
    dcp_load(model, opt, str(tmp_path / "ckpt-aligned"))
    train(model, opt, data[2:])
    ref = aligned_model()
    ref_opt = make_opt("adamw", ref.parameters())
    train(ref, ref_opt, data)
    assert_same_run(model, opt, ref, ref_opt)


def hsdp_worker(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    check_int8_equals_one_process(mesh, ALIGNED_ON_2)


def test_int8_states_on_hsdp_two_by_two_equal_one_process():
    launch(hsdp_worker, 4, timeout=240)
