"""DCP (torch.distributed.checkpoint, one process, no process group) checkpoints of a fused optimizer.

A checkpoint saved in another state storage is refused in DCP's load planning, before anything is read or written:
afterwards the optimizer's states and groups and the model's params are bit for bit what they were (DCP loads in
place, into the optimizer's own state tensors, casting to their dtype). Both documented ways: get_state_dict /
set_state_dict, and a plain dcp.load into model.state_dict() and optimizer.state_dict(). A checkpoint of the same
storage resumes bit for bit, written today (state_dtype tags) or before (state_dtype names, main's format).
(2 FSDP2 ranks: tests/distributed/test_fsdp_lowbit_refusal.py.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _state_snapshot import changed, snapshot
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from gradacc_ext.optim import FusedAdamW
from gradacc_ext.optim.state_tag import read_storage_tags

pytestmark = [
    pytest.mark.usefixtures("one_cpu_thread"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),  # DCP in one process says so
]
# (state_dtype, int8_min_numel): 0.weight [80, 64] has 5120 elements, int8 at the default 4096; the others keep fp32
INT8, INT8_ALL = ("int8", 4096), ("int8", 0)
FP32, BF16 = ("fp32", 4096), ("bf16", 4096)
MISMATCHES = [(INT8, FP32), (BF16, FP32), (FP32, BF16), (INT8, BF16), (FP32, INT8), (BF16, INT8), (INT8_ALL, INT8)]
PATHS = ("get_state_dict", "plain")


def make(storage: tuple[str, int], seed: int) -> tuple[torch.nn.Module, FusedAdamW]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Tanh(), torch.nn.Linear(80, 3))
    state_dtype, min_numel = storage
    return model, FusedAdamW(model.parameters(), lr=1e-2, state_dtype=state_dtype, int8_min_numel=min_numel, seed=seed)


def train(model: torch.nn.Module, opt: FusedAdamW, gen: torch.Generator, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        x, y = torch.randn(6, 64, generator=gen), torch.randn(6, 3, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def save(model: torch.nn.Module, opt: FusedAdamW, path: str, ckpt: str, names: bool = False) -> None:
    """names: each group's state_dtype saved as its name, as checkpoints written before the tags hold it."""
    msd, osd = get_state_dict(model, opt) if path == "get_state_dict" else (model.state_dict(), opt.state_dict())
    if names:
        osd = read_storage_tags(opt, osd)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)


def load(model: torch.nn.Module, opt: FusedAdamW, path: str, ckpt: str) -> None:
    msd, osd = get_state_dict(model, opt) if path == "get_state_dict" else (model.state_dict(), opt.state_dict())
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    if path == "get_state_dict":
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("saved", "loaded"), MISMATCHES, ids=lambda s: f"{s[0]}-{s[1]}")
def test_a_checkpoint_of_another_storage_is_refused_before_anything_is_written(tmp_path, gen, saved, loaded, path):
    model, opt = make(saved, seed=1)
    train(model, opt, gen, 2)
    save(model, opt, path, str(tmp_path))
    model, opt = make(loaded, seed=2)
    train(model, opt, gen, 1)  # states that differ from the checkpoint's everywhere
    before = snapshot(model, opt)
    with pytest.raises((CheckpointException, ValueError)) as refused:  # ValueError: load_state_dict's, after DCP
        load(model, opt, path, str(tmp_path))
    assert changed(before, snapshot(model, opt)) == []  # nothing read into the optimizer, nor the model
    assert isinstance(refused.value, CheckpointException), repr(refused.value)
    assert refused.match(r"Size mismatch .* for optim\.param_groups\.0\.state_dtype|Missing key .*exp_avg_scales")
    train(model, opt, gen, 1)  # the optimizer still steps


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("names", [False, True], ids=["tags", "names"])
@pytest.mark.parametrize("storage", [FP32, BF16, INT8, INT8_ALL], ids=lambda s: f"{s[0]}-{s[1]}")
def test_a_checkpoint_of_the_same_storage_resumes_bit_for_bit(tmp_path, gen, storage, names, path):
    seed = int(torch.randint(0, 2**31, (), generator=gen))
    whole, whole_opt = make(storage, seed=3)
    train(whole, whole_opt, torch.Generator().manual_seed(seed), 4)

    model, opt = make(storage, seed=3)
    data = torch.Generator().manual_seed(seed)
    train(model, opt, data, 2)
    save(model, opt, path, str(tmp_path), names=names)
    model, opt = make(storage, seed=4)  # other params, another rounding seed: the checkpoint brings both
    train(model, opt, torch.Generator().manual_seed(seed + 1), 1)
    load(model, opt, path, str(tmp_path))
    train(model, opt, data, 2)
    assert changed(snapshot(whole, whole_opt), snapshot(model, opt)) == []


def test_a_state_dtype_tensor_that_is_no_tag_is_refused_before_anything_is_written(gen):
    model, opt = make(INT8, seed=5)
    train(model, opt, gen, 1)
    state_dict = opt.state_dict()
    assert tuple(state_dict["param_groups"][0]["state_dtype"].shape) == (0, 2, 4, 3)  # int8; 3 of 4 params in fp32
    state_dict["param_groups"][0]["state_dtype"] = torch.empty(0, 3, 4, 3)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['state_dtype'\] is a tensor of shape \[0, 3, 4, 3\]"):
        opt.load_state_dict(state_dict)
    assert changed(before, snapshot(model, opt)) == []
