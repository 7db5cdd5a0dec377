"""state_convert on FSDP2 state_dicts (2 gloo ranks): DTensor int8 states convert shard by shard to torch's fp32
form and back, equal bit for bit to converting the gathered (full) tensors in one piece; a DTensor int8 state that
cannot be read shard by shard, or a state not laid out as its param, is refused with a ValueError naming it."""

from __future__ import annotations

import pytest
import torch
from _dist import launch, needs_gloo
from _lowbit_dist import ALIGNED_ON_2, batches, full, make_opt, mixed_model, sharded, train
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from gradacc_ext.optim.state_convert import dequantize, from_torch_state_dict, quantize, to_torch_state_dict

pytestmark = [pytest.mark.distributed, needs_gloo]
KEYS = {"exp_avg": True, "exp_avg_sq": False}  # AdamW's states, signed or not


def check_to_torch(mesh) -> None:
    model = sharded(mixed_model(), mesh)
    opt = make_opt("adamw", model.parameters())
    train(model, opt, batches(2, seed=51))
    plain = to_torch_state_dict(opt.state_dict())
    for pid, (name, p) in enumerate(model.named_parameters()):
        state, converted = opt.state[p], plain["state"][pid]
        assert sorted(converted) == ["exp_avg", "exp_avg_sq", "step"], (name, sorted(converted))
        for key in KEYS:
            got = converted[key]
            assert isinstance(got, DTensor) and got.placements == p.placements and got.dtype == torch.float32
            if name in ALIGNED_ON_2:  # the gathered codes decoded in one piece: the reference
                codes, scales = full(state[key]), full(state[key + "_scales"])
                assert torch.equal(full(got), dequantize(codes, scales, state[key + "_map"])), (name, key)
            else:  # a fallback's fp32 state, as it is
                assert torch.equal(full(got), full(state[key])), (name, key)
    torch.optim.AdamW(model.parameters()).load_state_dict(plain)  # torch's own optimizer takes it


def check_from_torch(mesh) -> None:
    model = sharded(mixed_model(), mesh)
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, torch_opt, batches(2, seed=53))
    opt = make_opt("adamw", model.parameters())
    opt.load_state_dict(from_torch_state_dict(torch_opt.state_dict(), opt))
    for name, p in model.named_parameters():
        for key, signed in KEYS.items():
            value, state = torch_opt.state[p][key], opt.state[p][key]
            assert isinstance(state, DTensor) and state.placements == p.placements
            if name in ALIGNED_ON_2:  # the gathered values quantized in one piece: the reference
                codes, scales = quantize(full(value), signed)
                assert torch.equal(full(state), codes) and torch.equal(full(opt.state[p][key + "_scales"]), scales)
            else:
                assert torch.equal(full(state), full(value)), (name, key)
    train(model, opt, batches(1, seed=55))  # and steps from them


def check_refusals(mesh) -> None:
    model = sharded(mixed_model(), mesh)
    opt = make_opt("adamw", model.parameters())
    train(model, opt, batches(1, seed=57))
    saved = opt.state_dict()
    # 4.weight [3, 512] on 2 ranks: whole blocks 4 | 2, but its 6 scales split 3 | 3
    torch.manual_seed(0)
    codes = distribute_tensor(torch.randint(0, 256, (3, 512), dtype=torch.uint8), mesh, [Shard(0)])
    scales = distribute_tensor(torch.rand(6) + 0.5, mesh, [Shard(0)])
    saved["state"][4] = {**saved["state"][4], "exp_avg": codes, "exp_avg_scales": scales}
    saved["state"][4]["exp_avg_map"] = "dynamic_signed"
    with pytest.raises(ValueError, match=r"to_torch_state_dict: param 4: exp_avg: a DTensor int8 state that cannot"):
        to_torch_state_dict(saved)
    torch_sd = torch.optim.AdamW(model.parameters()).state_dict()
    torch_sd["state"] = {
        0: {"step": torch.tensor(1.0), "exp_avg": torch.rand(3, 384), "exp_avg_sq": torch.rand(3, 384)}
    }
    with pytest.raises(ValueError, match=r"from_torch_state_dict: param 0: exp_avg is Tensor \[3, 384\], its param "):
        from_torch_state_dict(torch_sd, opt)


def worker(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    check_to_torch(mesh)
    check_from_torch(mesh)
    check_refusals(mesh)


def test_state_convert_on_fsdp2_state_dicts_shard_by_shard():
    launch(worker, 2, timeout=120)
