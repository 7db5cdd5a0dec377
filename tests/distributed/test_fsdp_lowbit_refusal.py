"""An FSDP2 checkpoint whose params fell back to fp32 states, loaded where they are int8: refused BEFORE anything is
written (2 gloo ranks). DCP loads in place, into the loading optimizer's own state tensors, so the refusal must come
in its load planning: afterwards the optimizer's state (tensors, maps, step counts, groups) and the model's params
are bit for bit what they were. The same state_dict given to load_state_dict directly is refused before any write too.
"""

from __future__ import annotations

import pytest
from _dist import launch, needs_gloo
from _lowbit_dist import ALIGNED_ON_2, batches, dcp_load, dcp_save, make_opt, mixed_model, sharded, train
from _state_snapshot import changed, snapshot
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh

from gradacc_ext.optim.state_shards import int8_fallback_reason

pytestmark = [pytest.mark.distributed, needs_gloo]
# DCP's planning error: the checkpoint holds a fallback's placeholder tensor where this state_dict has a code book name
REFUSED = r"Invalid checkpoint metadata for optim\.state\.0\.bias\.exp_avg_map, expected BytesStorageMetadata"


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
