"""Low-bit optimizer states (state_dtype "int8" / "bf16") under FSDP2 and HSDP, and their DCP checkpoints.

Every rank trains on the same batches, so FSDP2's averaged grads are one process's exactly and the runs can be
compared bit for bit: on block-aligned params the int8 step on the shards equals one process's (params, codes,
scales); unaligned params keep fp32 states (one process with those params in an fp32 group is the reference).
Checkpoints: resume at the same world size; 2 ranks -> 1 process (aligned: exact; a param that fell back on 2
ranks: refused before anything is read); 1 process -> 2 ranks (the params that fall back there: dequantized into
fp32 states).
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
    full,
    make_opt,
    mixed_model,
    sharded,
    split_groups,
    train,
    train_accumulated,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from gradacc_ext.ops.quant_maps import BLOCK
from gradacc_ext.optim.state_convert import dequantize
from gradacc_ext.optim.state_shards import int8_fallback_reason

pytestmark = [pytest.mark.distributed, needs_gloo]
STEPS = 4


@pytest.fixture
def one_thread():
    """This process computes with one thread, as the ranks do (_dist.launch): its runs and theirs compare bitwise."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def check_bf16_near_one_process(mesh) -> None:
    """bf16 states are bf16 DTensors sharded like their params; their stochastic rounding draws by position in
    the op's lists, which sharding changes, so the run is one process's within that rounding, not bit for bit."""
    data = batches(STEPS, seed=29)
    model = sharded(mixed_model(), mesh)
    opt = make_opt("adamw", model.parameters(), "bf16")
    train(model, opt, data)
    ref = mixed_model()
    ref_opt = make_opt("adamw", ref.parameters(), "bf16")
    train(ref, ref_opt, data)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(full(p.detach()), q.detach(), rtol=0, atol=1e-3)
        for key in ("exp_avg", "exp_avg_sq"):
            state = opt.state[p][key]
            assert isinstance(state, DTensor) and state.dtype == torch.bfloat16 and state.placements == p.placements
            theirs = ref_opt.state[q][key].float()  # within a few bf16 steps of the state's scale
            torch.testing.assert_close(full(state).float(), theirs, rtol=0, atol=2e-2 * theirs.abs().max().item())


def check_fallbacks_reported_and_accumulated(mesh) -> None:
    """repr and the accumulator's stats name each fallback and why; the accumulator's fused tail on int8 shards
    equals one process's."""
    data = batches(STEPS, seed=23)
    model = sharded(mixed_model(), mesh)
    opt = make_opt("adamw", model.parameters())
    acc = train_accumulated(model, opt, data)
    ref = mixed_model()
    ref_opt = make_opt("adamw", split_groups(ref, ALIGNED_ON_2))
    train_accumulated(ref, ref_opt, data)
    assert_same_run(model, opt, ref, ref_opt)
    assert acc.optimizer_steps == STEPS // 2 and acc.get_accumulation_stats()["fused_step"]
    fallbacks = acc.get_accumulation_stats()["optimizer_state_fallbacks"]
    unaligned = [i for i, (name, _) in enumerate(model.named_parameters()) if name not in ALIGNED_ON_2]
    assert list(fallbacks[0]) == unaligned
    assert "holds blocks (0, 4), but its 6 scales split as (0, 3)" in fallbacks[0][4]  # 4.weight
    assert f"group 0 param 4 [3, 512]: fp32 states, {fallbacks[0][4]}" in repr(opt)
    assert "int8 fallbacks" not in repr(ref_opt)  # one process: nothing falls back


def check_bf16_params_in_master_mode(mesh) -> None:
    """bf16 params, float32 masters (DTensors too) and int8 states: one process's bit for bit."""
    data = [(x.bfloat16(), y.bfloat16()) for x, y in batches(STEPS, seed=31)]
    model = sharded(mixed_model().bfloat16(), mesh)
    opt = make_opt("adamw", model.parameters(), param_mode="master")
    train(model, opt, data)
    ref = mixed_model().bfloat16()
    ref_opt = make_opt("adamw", split_groups(ref, ALIGNED_ON_2), param_mode="master")
    train(ref, ref_opt, data)
    assert_same_run(model, opt, ref, ref_opt)
    assert all(isinstance(opt.state[p]["master_param"], DTensor) for p in model.parameters())


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
    check_bf16_near_one_process(mesh)
    check_bf16_params_in_master_mode(mesh)
    check_fallbacks_reported_and_accumulated(mesh)
    check_resume(mesh, ckpt)
    # for the world-size-1 load: every param aligned, saved after 2 steps
    model = sharded(aligned_model(), mesh)
    opt = make_opt("adamw", model.parameters())
    train(model, opt, batches(2, seed=17, out=1024))
    dcp_save(model, opt, ckpt + "-aligned")


def test_int8_states_on_two_fsdp2_ranks_equal_one_process_and_resume(tmp_path, one_thread):
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
    # a param that fell back to fp32 states on 2 ranks is int8 here: refused in DCP's planning, before any read
    # (that nothing is written: tests/distributed/test_fsdp_lowbit_refusal.py)
    model = mixed_model()
    opt = make_opt("adamw", model.parameters())
    refused = r"Invalid checkpoint metadata for optim\.state\.0\.bias\.exp_avg_map, expected BytesStorageMetadata"
    with pytest.raises(CheckpointException, match=refused):
        dcp_load(model, opt, str(tmp_path / "ckpt-adamw-int8"))


def dequantized_reference(model, opt, aligned: tuple[str, ...]) -> torch.optim.Optimizer:
    """An optimizer over one process's `model` that holds `opt`'s int8 states for the `aligned` params and the
    others' dequantized into fp32 states (what loading at a layout where they fall back must give)."""
    ref_opt = make_opt("adamw", split_groups(model, aligned))
    for name, p in model.named_parameters():
        state = opt.state[p]
        if name in aligned:
            ref_opt.state[p] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        else:
            codes = {
                k: dequantize(state[k], state[k + "_scales"], state[k + "_map"]) for k in ("exp_avg", "exp_avg_sq")
            }
            ref_opt.state[p] = {"step": state["step"].clone(), **codes}
    return ref_opt


def reshard_worker(rank: int, world: int, ckpt: str) -> None:
    """A one-process checkpoint (every param int8) loaded on 2 ranks, then 2 more steps. 4.weight shards along
    dim 1 here: its shards are not element ranges, dequantized all the same."""
    mesh = init_device_mesh("cpu", (world,))
    data = batches(STEPS, seed=19)
    plain = mixed_model()
    plain_opt = make_opt("adamw", plain.parameters())
    train(plain, plain_opt, data[:2])  # what the checkpoint holds
    ref_opt = dequantized_reference(plain, plain_opt, ALIGNED_ON_2)
    model = sharded(mixed_model(seed=5), mesh, dim1=(4,))
    assert model[4].weight.placements == (Shard(1),) and "placement S(1)" in int8_fallback_reason(model[4].weight)
    opt = make_opt("adamw", model.parameters())
    dcp_load(model, opt, ckpt)
    assert_same_run(model, opt, plain, ref_opt)
    train(model, opt, data[2:])
    train(plain, ref_opt, data[2:])
    assert_same_run(model, opt, plain, ref_opt)


def test_one_process_int8_checkpoint_loads_on_two_ranks_dequantizing_where_unaligned(tmp_path, one_thread):
    model = mixed_model()
    opt = make_opt("adamw", model.parameters())
    train(model, opt, batches(2, seed=19))
    dcp_save(model, opt, str(tmp_path / "plain"))
    launch(reshard_worker, 2, str(tmp_path / "plain"), timeout=240)


def hsdp_worker(rank: int, world: int, ckpt: str) -> None:
    """Shard(0) over the 2 shard ranks, Replicate over the 2 replicas: the scales the same way."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    check_int8_equals_one_process(mesh, ALIGNED_ON_2)
    check_resume(mesh, ckpt)


def test_int8_states_on_hsdp_two_by_two_equal_one_process_and_resume(tmp_path):
    launch(hsdp_worker, 4, str(tmp_path / "ckpt"), timeout=240)
