"""gradacc_ext.optim.state_convert: the block quantizer against a float64 nearest-code search, fused state_dicts
to and from torch's fp32 form (fp32 exact, int8 within the nearest code, bf16 rounded once), and
load_state_dict refusing, before any write, a state that does not fit its param."""

from __future__ import annotations

import copy

import pytest
import torch
from _optim_inputs import OPTIMIZERS

from gradacc_ext.ops.quant_maps import BLOCK, code_values, map_name
from gradacc_ext.optim.state_convert import GROUP_KEYS, dequantize, from_torch_state_dict, quantize, to_torch_state_dict

OPTIONS = {"adamw": {"lr": 1e-2}, "sgd": {"lr": 0.05, "momentum": 0.9}, "lion": {"lr": 1e-3}}
SIZES = [(50, 100), (33,)]  # 5000 elements: past the 4096 threshold, a partial last block; 33: below it
ROWS = [pytest.param(info, id=info.name) for info in OPTIMIZERS]


def nearest_error(x: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    """Per element, float64: the distance from x to the nearest value code x block scale, plus the float32
    roundings of the coder's decision (x / scale and the midpoints: a few 2**-24 of the scale)."""
    s = scales.double().repeat_interleave(BLOCK)[: x.numel()]
    candidates = code_values(signed).double()[None, :] * s[:, None]
    return (candidates - x.reshape(-1, 1).double()).abs().amin(dim=1) + 2.0**-22 * s


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_takes_the_nearest_code_of_each_blocks_absmax(gen, signed):
    x = torch.randn(3 * BLOCK + 77, generator=gen) * torch.logspace(-4, 1, 3 * BLOCK + 77)
    x = x if signed else x.abs()
    x[BLOCK : 2 * BLOCK] = 0.0  # an all-zero block: scale 0, decodes to 0
    codes, scales = quantize(x, signed)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and scales.dtype == torch.float32
    blocks = torch.nn.functional.pad(x, (0, 4 * BLOCK - x.numel())).reshape(4, BLOCK)
    torch.testing.assert_close(scales, blocks.abs().amax(dim=1), rtol=0, atol=0)
    err = (dequantize(codes, scales, map_name(signed)).double() - x.double()).abs()
    assert (err <= nearest_error(x, scales, signed)).all()
    assert (dequantize(codes, scales, map_name(signed))[BLOCK : 2 * BLOCK] == 0).all()


def test_dequantize_refuses_an_unknown_map():
    with pytest.raises(ValueError, match="map_name must be one of"):
        dequantize(torch.zeros(3, dtype=torch.uint8), torch.ones(1), "linear")


def stepped_oracle(info, gen, steps: int = 3) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    """The row's oracle (torch.optim's, lion-pytorch's) after a few steps on random grads."""
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SIZES]
    opt = info.oracle(params, **OPTIONS[info.name])
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt, params


@pytest.mark.parametrize("info", ROWS)
def test_torch_to_int8_to_torch_is_within_the_nearest_code(gen, info):
    oracle, params = stepped_oracle(info, gen)
    saved = copy.deepcopy(oracle.state_dict())
    fused = info.fused([torch.nn.Parameter(p.detach().clone()) for p in params], state_dtype="int8")
    fused.load_state_dict(from_torch_state_dict(saved, fused))
    big, small = (fused.state[p] for p in fused.param_groups[0]["params"])
    keys = fused._state_keys[:2] if info.name == "adamw" else fused._state_keys
    for slot, key in enumerate(keys):
        assert big[key].dtype == torch.uint8 and big[key + "_scales"].numel() == -(-5000 // BLOCK)
        assert big[key + "_map"] == map_name(info.record.SIGNED[slot])
        assert small[key].dtype == torch.float32  # below int8_min_numel
    back = to_torch_state_dict(fused.state_dict())
    assert not set(GROUP_KEYS) & set(back["param_groups"][0])  # the keys torch lacks are dropped
    for pid, want in saved["state"].items():
        for slot, key in enumerate(keys):
            got = back["state"][pid][key]
            assert got.dtype == torch.float32 and got.shape == want[key].shape
            if want[key].numel() < 4096:
                assert torch.equal(got, want[key])
            else:
                scales = fused.state_dict()["state"][pid][key + "_scales"]
                bound = nearest_error(want[key], scales, info.record.SIGNED[slot]).reshape(got.shape)
                assert ((got.double() - want[key].double()).abs() <= bound).all()
    torch.optim.Optimizer.load_state_dict(oracle, back)  # torch's own loader takes it


@pytest.mark.parametrize("info", ROWS)
def test_fp32_states_round_trip_exactly(gen, info):
    oracle, params = stepped_oracle(info, gen)
    saved = copy.deepcopy(oracle.state_dict())
    fused = info.fused([torch.nn.Parameter(p.detach().clone()) for p in params])
    fused.load_state_dict(from_torch_state_dict(saved, fused))
    back = to_torch_state_dict(fused.state_dict())
    for pid, want in saved["state"].items():
        for key in fused._state_keys:
            if key in want:
                assert torch.equal(back["state"][pid][key], want[key])


def test_bf16_states_are_rounded_once_and_widen_exactly(gen):
    oracle, params = stepped_oracle(OPTIMIZERS[0], gen)
    fused = OPTIMIZERS[0].fused([torch.nn.Parameter(p.detach().clone()) for p in params], state_dtype="bf16")
    fused.load_state_dict(from_torch_state_dict(oracle.state_dict(), fused))
    for p, want in zip(fused.param_groups[0]["params"], oracle.state.values(), strict=True):
        assert torch.equal(fused.state[p]["exp_avg"], want["exp_avg"].to(torch.bfloat16))
    back = to_torch_state_dict(fused.state_dict())
    for pid, state in fused.state_dict()["state"].items():
        assert torch.equal(back["state"][pid]["exp_avg_sq"], state["exp_avg_sq"].float())


def int8_adamw(gen) -> torch.optim.Optimizer:
    oracle, params = stepped_oracle(OPTIMIZERS[0], gen)
    fused = OPTIMIZERS[0].fused([torch.nn.Parameter(p.detach().clone()) for p in params], state_dtype="int8")
    fused.load_state_dict(from_torch_state_dict(oracle.state_dict(), fused))
    return fused


BAD = {
    "codes shape": (lambda s: s.__setitem__("exp_avg", s["exp_avg"].reshape(-1)), "has shape"),
    "codes dtype": (lambda s: s.__setitem__("exp_avg", s["exp_avg"].float()), "is torch.float32, but"),
    "scales numel": (lambda s: s.__setitem__("exp_avg_scales", s["exp_avg_scales"][:-1]), "expected float32"),
    "scales dtype": (lambda s: s.__setitem__("exp_avg_sq_scales", s["exp_avg_sq_scales"].double()), "expected"),
    "scales missing": (lambda s: s.pop("exp_avg_scales"), "is missing"),
    "map name": (lambda s: s.__setitem__("exp_avg_sq_map", "dynamic_signed"), "expected 'dynamic_unsigned'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_state_that_does_not_fit_its_param_is_refused_before_any_write(gen, case):
    fused = int8_adamw(gen)
    before = copy.deepcopy(fused.state_dict())
    bad = copy.deepcopy(before)
    for state in bad["state"].values():
        state["step"] += 5  # would be written if anything were
    spoil, match = BAD[case]
    spoil(bad["state"][0])
    with pytest.raises(ValueError, match=match):
        fused.load_state_dict(bad)
    after = fused.state_dict()
    for pid, state in before["state"].items():
        for key, value in state.items():
            assert (
                torch.equal(after["state"][pid][key], value)
                if torch.is_tensor(value)
                else after["state"][pid][key] == value
            )


def test_an_fp32_state_into_int8_storage_is_refused_naming_the_helper(gen):
    oracle, params = stepped_oracle(OPTIMIZERS[0], gen)
    fused = OPTIMIZERS[0].fused([torch.nn.Parameter(p.detach().clone()) for p in params], state_dtype="int8")
    with pytest.raises(ValueError, match="param 0 of group 0: exp_avg is torch.float32.*from_torch_state_dict"):
        fused.load_state_dict(oracle.state_dict())
    assert not fused.state
