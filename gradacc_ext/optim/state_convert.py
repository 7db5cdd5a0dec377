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

FSDP2/HSDP state_dicts (DTensor states) convert shard by shard, each rank its own blocks, with no communication:
an int8 state's codes are then whole global blocks on every rank, its piece of the scales theirs (state_shards.py),
and the result is a DTensor laid out as the input. A DTensor int8 state laid out otherwise, or a state whose layout
is not its param's, is refused with a ValueError naming the param and the key: gather such a state_dict first.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from ..ops import reference_lowbit
from ..ops.quant_maps import BLOCK, NAMES, map_name
from .shards import is_sharded
from .state_shards import misalignment, scales_placements
from .state_storage import MAP, SCALES, storage_of, stored_dtype

if TYPE_CHECKING:
    from ._fused import FusedOptimizer

GROUP_KEYS = ("state_dtype", "int8_min_numel", "seed")  # the fused optimizers' group keys torch lacks
GATHER_HINT = "gather the state_dict first (get_state_dict with StateDictOptions(full_state_dict=True))"


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
                value = _decoded(value, saved[key + SCALES], saved[key + MAP], f"param {pid}: {key}")
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
                plain["state"][pid] = _stored(optimizer, plain["state"][pid], param, storage_of(param, group), pid)
    return plain


def _stored(
    optimizer: FusedOptimizer, state: dict[str, Any], param: torch.Tensor, storage: str, pid: Any
) -> dict[str, Any]:
    """A param's fp32 state dict with its optimizer state keys in `storage`."""
    for slot, key in enumerate(optimizer._state_keys):
        value = state.get(key)
        if not isinstance(value, torch.Tensor) or storage == "fp32":
            continue
        if storage == "bf16":
            state[key] = value.to(stored_dtype(param, storage))
            continue
        signed = optimizer._record.SIGNED[slot]
        if is_sharded(param) or is_sharded(value):
            state[key], state[key + SCALES] = _encoded_shards(value, param, signed, f"param {pid}: {key}")
        else:
            state[key], state[key + SCALES] = quantize(value, signed)
        state[key + MAP] = map_name(signed)
    return state


def _decoded(codes: Any, scales: Any, name: str, where: str) -> torch.Tensor:
    """dequantize; shard by shard for DTensor codes and scales, when each rank's codes are whole global blocks."""
    if not is_sharded(codes) and not is_sharded(scales):
        return dequantize(codes, scales, name)
    if not (is_sharded(codes) and is_sharded(scales)) or codes.device_mesh != scales.device_mesh:
        why = f"its codes are {_layout(codes)} and its scales {_layout(scales)}, not DTensors on one mesh"
    else:
        why = misalignment(tuple(codes.shape), tuple(codes.device_mesh.shape), tuple(codes.placements))
        expected = scales_placements(tuple(codes.placements))
        if why is None and (tuple(scales.placements), tuple(scales.shape)) != (expected, (_blocks(codes),)):
            why = f"its scales are {_layout(scales)}, expected [{_blocks(codes)}] placed {expected}"
    if why is not None:
        raise ValueError(
            f"to_torch_state_dict: {where}: a DTensor int8 state that cannot be read shard by shard: {why}; "
            + GATHER_HINT
        )
    return _sharded_like(dequantize(codes.to_local(), scales.to_local(), name), codes)


def _encoded_shards(value: Any, param: torch.Tensor, signed: bool, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize shard by shard: `value` laid out as the DTensor `param` (block-aligned, since its storage is int8)."""
    from torch.distributed.tensor import DTensor

    if _layout(value) != _layout(param) or not is_sharded(value) or value.device_mesh != param.device_mesh:
        raise ValueError(
            f"from_torch_state_dict: {where} is {_layout(value)}, its param {_layout(param)}: an int8 state is "
            "quantized where it lies, so it must be laid out as its param, on its mesh: convert a state_dict taken "
            "at this optimizer's layout (a full one, get_state_dict with StateDictOptions(full_state_dict=True), "
            "for an optimizer over plain tensors)"
        )
    codes, scales = quantize(value.to_local(), signed)
    placements = scales_placements(tuple(param.placements))
    blocks = (_blocks(param),)
    scales = DTensor.from_local(scales, param.device_mesh, placements, run_check=False, shape=blocks, stride=(1,))
    return _sharded_like(codes, value), scales


def _layout(tensor: Any) -> str:
    """ "DTensor [3, 384] (Shard(dim=0),)" or "Tensor [3, 384]": what a state's layout must match."""
    placed = f" {tuple(tensor.placements)}" if is_sharded(tensor) else ""
    return f"{type(tensor).__name__} {list(tensor.shape)}{placed}"


def _blocks(tensor: torch.Tensor) -> int:
    return -(-tensor.numel() // BLOCK)


def _sharded_like(local: torch.Tensor, like: Any) -> torch.Tensor:
    """A DTensor of `local` pieces laid out as the DTensor `like` (shape, stride, mesh, placements)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def _without_ours(group: dict[str, Any]) -> dict[str, Any]:
    return {key: copy.deepcopy(value) for key, value in group.items() if key not in GROUP_KEYS}
