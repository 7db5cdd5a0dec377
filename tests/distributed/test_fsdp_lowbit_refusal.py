"""FSDP2 checkpoints loaded where a param's state storage differs: refused BEFORE anything is written (2 gloo ranks).
DCP loads in place, into the loading optimizer's own state tensors, so the refusal must come in its load planning:
afterwards the optimizer's state (tensors, maps, step counts, groups) and the model's params are bit for bit what
they were. Cases: params that fell back to fp32 states loaded where they are int8 (the same state_dict given to
load_state_dict directly is refused before any write too); an int8 group's checkpoint loaded into fp32 or bf16
groups at the same layout. A checkpoint in main's format (state_dtype names, a fallback's map "fp32") loads at its
own layout exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import launch, needs_gloo
from _lowbit_dist import (
    ALIGNED_ON_2,
    assert_same_run,
    batches,
    dcp_load,
    dcp_save,
    make_opt,
    mixed_model,
    sharded,
    train,
)
from _state_snapshot import changed, snapshot
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh

from gradacc_ext.optim.state_shards import int8_fallback_reason
from gradacc_ext.optim.state_tag import read_storage_tags

pytestmark = [pytest.mark.distributed, needs_gloo]
# DCP's planning error: the checkpoint holds a fallback's placeholder tensor where this state_dict has a code book name
REFUSED = r"Invalid checkpoint metadata for optim\.state\.0\.bias\.exp_avg_map, expected BytesStorageMetadata"
MAINS_FALLBACK_MAP = "fp32"  # a fallback's <key>_map in the checkpoints main writes (state_reshard.FALLBACK_MAP there)
# ... and the group's state_dtype tag: int8, 10 params, none kept in fp32 by the group's rules (state_tag.py)
OTHER_STORAGE = r"Size mismatch between saved torch\.Size\(\[0, 2, 10, 0\]\) .* for optim\.param_groups\.0\.state_dtype"


def refusal_worker(rank: int, world: int, ckpt: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    saved = sharded(mixed_model(), mesh)  # 0.bias, 4.*, 6.* keep fp32 states on 2 ranks
    saved_opt = make_opt("adamw", saved.parameters())
    assert int8_fallback_reason(saved[0].bias) is not None and "0.bias" not in ALIGNED_ON_2
    train(saved, saved_opt, batches(2, seed=41))
    dcp_save(saved, saved_opt, ckpt)

    plain = mixed_model(seed=5)  # unsharded on each rank: every param int8
    opt = make_opt("adamw", plain.parameters())
    train(plain, opt, batches(1, seed=43))  # a state that differs from the checkpoint's everywhere
    before = snapshot(plain, opt)
    with pytest.raises((CheckpointException, ValueError)) as refused:  # ValueError: refused after DCP's writes
        dcp_load(plain, opt, ckpt)
    diff = changed(before, snapshot(plain, opt))
    assert diff == [], f"written before the refusal: {diff}"  # nothing read into the optimizer (nor the model)
    assert isinstance(refused.value, CheckpointException), repr(refused.value)
    assert refused.match(REFUSED)
    train(plain, opt, batches(1, seed=47))  # the optimizer still steps
    before = snapshot(plain, opt)
    with pytest.raises(ValueError, match=r"exp_avg of param 1 \(shape \[3\]\) was saved in fp32 states .* nothing"):
        opt.load_state_dict(saved_opt.state_dict())  # no DCP: load_state_dict's own check
    diff = changed(before, snapshot(plain, opt))
    assert diff == [], f"written before the refusal: {diff}"


def test_fallback_checkpoint_into_int8_states_is_refused_before_anything_is_written(tmp_path):
    launch(refusal_worker, 2, str(tmp_path / "ckpt"), timeout=120)


def save_in_mains_format(model, opt, ckpt: str) -> None:
    """A DCP checkpoint as main wrote it: each group's state_dtype a name, each fallback's <key>_map "fp32"."""
    msd, osd = get_state_dict(model, opt)
    osd = read_storage_tags(opt, osd)
    for state in osd["state"].values():
        state.update({k: MAINS_FALLBACK_MAP for k, v in state.items() if k.endswith("_map") and torch.is_tensor(v)})
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)


def storage_worker(rank: int, world: int, ckpt: str, mains: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    saved = sharded(mixed_model(), mesh)  # int8: 0.weight, 2.*, 8.* aligned; the others fall back to fp32 states
    saved_opt = make_opt("adamw", saved.parameters())
    train(saved, saved_opt, batches(2, seed=51))
    dcp_save(saved, saved_opt, ckpt)
    save_in_mains_format(saved, saved_opt, mains)
    for state_dtype in ("fp32", "bf16"):  # the same layout, another storage: DCP would cast the codes into the states
        model = sharded(mixed_model(seed=5), mesh)
        opt = make_opt("adamw", model.parameters(), state_dtype=state_dtype)
        train(model, opt, batches(1, seed=53))
        before = snapshot(model, opt)
        with pytest.raises((CheckpointException, ValueError)) as refused:  # ValueError: refused after DCP's writes
            dcp_load(model, opt, ckpt)
        diff = changed(before, snapshot(model, opt))
        assert diff == [], f"{state_dtype}: written before the refusal: {diff}"
        assert refused.match(OTHER_STORAGE)
    model = sharded(mixed_model(seed=5), mesh)
    opt = make_opt("adamw", model.parameters())
    train(model, opt, batches(1, seed=53))
    dcp_load(model, opt, mains)  # main's format at its own layout: exact
    assert_same_run(model, opt, saved, saved_opt)


def test_a_checkpoint_of_another_storage_is_refused_before_anything_is_written_on_two_ranks(tmp_path):
    launch(storage_worker, 2, str(tmp_path / "ckpt"), str(tmp_path / "mains"), timeout=120)
