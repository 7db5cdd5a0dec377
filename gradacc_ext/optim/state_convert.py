"""Converting a fused optimizer's state_dict to and from torch.optim's fp32 form, to switch optimizers mid-run.

    torch_sd = to_torch_state_dict(fused.state_dict())      # int8 / bf16 states dequantized to float32
    torch.optim.AdamW(model.parameters()).load_state_dict(torch_sd)

    fused = FusedAdamW(model.parameters(), state_dtype="int8")
    fused.load_state_dict(from_torch_state_dict(torch_adamw.state_dict(), fused))

`to_torch_state_dict` dequantizes every int8 state (code value x its block's scale, in float32, as the op
reads it) and widens every bf16 state to float32 exactly; it drops the scales, the maps' names and the group
keys torch does not know (state_dtype, int8_min_numel, seed). The result loads into torch.optim.AdamW (from
FusedAdamW), SGD (FusedSGD) or lion-pytorch's Lion (FusedLion), and into a fused optimizer with fp32 states.

`from_torch_state_dict` brings an fp32 state_dict (torch's, or any fused optimizer's: quantized states are
dequantized first) into the storage each param has in `optimizer`: int8 states are quantized per block of
256 elements (absmax scale, nearest code), bf16 states rounded to nearest; the groups take the optimizer's
state_dtype, int8_min_numel and seed. fp32 states pass unchanged, so an fp32 round trip is exact; an int8
one is within half a code step of each block's absmax.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from ..ops import reference_lowbit
from ..ops.quant_maps import NAMES, map_name
from .state_storage import MAP, SCALES, storage_of, stored_dtype

if TYPE_CHECKING:
    from ._fused import FusedOptimizer

GROUP_KEYS = ("state_dtype", "int8_min_numel", "seed")  # the fused optimizers' group keys torch lacks


def dequantize(codes: torch.Tensor, scales: torch.Tensor, map_name: str) -> torch.Tensor:
    """float32 values of int8 `codes` (any shape) with one `scales` entry per 256 elements, on map `map_name`."""
    if map_name not in NAMES:
        raise ValueError(f"dequantize: map_name must be one of {NAMES}, got {map_name!r}")
    return reference_lowbit.decode(codes, scales, map_name == NAMES[0], torch.float32)


def quantize(values: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes of `values`' shape, float32 scales: one absmax per 256 elements), the op's rule: a block's
    values divided by its absmax, each coded as the number of map midpoints strictly below it (NaN -> 0)."""
    return reference_lowbit.encode(values.detach().to(torch.float32), signed)


def to_torch_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of a fused optimizer's `state_dict` in torch's fp32 form (see the module's docstring)."""
    out = {"state": {}, "param_groups": [_without_ours(g) for g in state_dict["param_groups"]]}
    for pid, saved in state_dict["state"].items():
        state = {}
        for key, value in saved.items():
            if key.endswith((SCALES, MAP)) and key.removesuffix(SCALES).removesuffix(MAP) in saved:
                continue  # an int8 state's companion
            if isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and key + MAP in saved:
                value = dequantize(value, saved[key + SCALES], saved[key + MAP])
            elif isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16:
                value = value.to(torch.float32)
            else:
                value = copy.deepcopy(value)
            state[key] = value
        out["state"][pid] = state
    return out


def from_torch_state_dict(state_dict: dict[str, Any], optimizer: FusedOptimizer) -> dict[str, Any]:
    """`state_dict` (torch's fp32 form, or a fused optimizer's) in the storages `optimizer` keeps, to load into it.

    Groups and params are matched by position, as torch's load_state_dict matches them."""
    plain = to_torch_state_dict(state_dict)
    saved_groups = plain["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"from_torch_state_dict: state_dict has {len(saved_groups)} param groups, the optimizer "
            f"{len(optimizer.param_groups)}"
        )
    for saved_group, group in zip(saved_groups, optimizer.param_groups, strict=True):
        if len(saved_group["params"]) != len(group["params"]):
            raise ValueError(
                f"from_torch_state_dict: a param group of state_dict has {len(saved_group['params'])} params, the "
                f"optimizer's {len(group['params'])}"
            )
        saved_group.update({key: group[key] for key in GROUP_KEYS})
        for pid, param in zip(saved_group["params"], group["params"], strict=True):
            if pid in plain["state"]:
                plain["state"][pid] = _stored(optimizer, plain["state"][pid], param, storage_of(param, group))
    return plain


def _stored(optimizer: FusedOptimizer, state: dict[str, Any], param: torch.Tensor, storage: str) -> dict[str, Any]:
    """A param's fp32 state dict with its optimizer state keys in `storage`."""
    for slot, key in enumerate(optimizer._state_keys):
        value = state.get(key)
        if not isinstance(value, torch.Tensor) or storage == "fp32":
            continue
        if storage == "bf16":
            state[key] = value.to(stored_dtype(param, storage))
            continue
        signed = optimizer._record.SIGNED[slot]
        state[key], state[key + SCALES] = quantize(value, signed)
        state[key + MAP] = map_name(signed)
    return state


def _without_ours(group: dict[str, Any]) -> dict[str, Any]:
    return {key: copy.deepcopy(value) for key, value in group.items() if key not in GROUP_KEYS}
