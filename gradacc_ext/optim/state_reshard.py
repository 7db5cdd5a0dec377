"""A checkpoint of FSDP2/HSDP int8 states loaded at another layout (world size, mesh): what each state becomes.

A param quantizes exactly only where its shards are block-aligned (state_shards.py); elsewhere its int8 group
keeps it in fp32 states. torch.distributed.checkpoint (DCP) loads into the tensors of the loading optimizer's own
state_dict, in place, and casts what it reads to their dtype, so a state saved in one storage can arrive in the
other's tensors. To tell them apart, the state_dict of a param that fell back carries the int8 companions too
(`add_fallback_companions`, the state_dict post-hook): ``<key>_scales`` (zeros, laid out as an int8 state's) and
``<key>_map`` a placeholder TENSOR (`fallback_map`) where an int8 state has its code book's name, a str. At load,
per param:

* int8 saved, fp32 here: the codes (cast to float exactly by DCP, or uint8) are dequantized with the saved scales
  into fp32 states (`adapt_to_layout`, before the checks of state_load.py), exactly the values the step would
  have read; the run continues from them in fp32.
* fp32 saved (a fallback there), fp32 here: loaded as they are, the companions dropped.
* fp32 saved (a fallback there), int8 here: refused before anything is written. Under DCP its load planning
  refuses it, because the checkpoint holds a tensor where this optimizer's state_dict holds a str: a ValueError
  "Invalid checkpoint metadata for <prefix>.state.<param>.<key>_map, expected BytesStorageMetadata ..." (in a
  CheckpointException), before DCP reads anything, the model's entries included. DCP's planning calls nothing of
  ours to word it better: only a str subclass could, and torch.load(weights_only=True) refuses one in a saved
  state_dict. load_state_dict refuses a state_dict given directly (`adapt_to_layout`), naming the param.

Checkpoints written before the placeholder tensor hold LEGACY_FALLBACK_MAP (a str) there: they load as fallbacks
still, but DCP loads them where the param is int8 unchecked, and load_state_dict refuses after DCP's writes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from ..ops.quant_maps import BLOCK, code_values, map_name
from .shards import is_sharded
from .state_shards import scales_placements
from .state_storage import MAP, SCALES, int8_fallback, storage_of

if TYPE_CHECKING:
    from ._fused import FusedOptimizer


LEGACY_FALLBACK_MAP = "fp32"  # a fallback's <key>_map in checkpoints written before `fallback_map`


def fallback_map(device: torch.device) -> torch.Tensor:
    """A fallback's ``<key>_map`` placeholder: a tensor, so that DCP's planning refuses it where the loading state_dict
    holds an int8 state's code book name (a str), and a str where it holds this tensor."""
    return torch.zeros(1, device=device)


def is_fallback_map(saved_map: Any) -> bool:
    """Whether a saved ``<key>_map`` marks fp32 states of a fallback (`fallback_map`, or LEGACY_FALLBACK_MAP)."""
    return isinstance(saved_map, torch.Tensor) or saved_map == LEGACY_FALLBACK_MAP


def _placed(optimizer: FusedOptimizer, state_dict: dict[str, Any]) -> dict[Any, tuple[torch.Tensor, dict]]:
    """Saved param id -> (param, its group's keys as loading will make them: the checkpoint's over the defaults)."""
    placed = {}
    for saved_group, group in zip(state_dict["param_groups"], optimizer.param_groups, strict=False):
        loaded = {**optimizer.defaults, **{k: v for k, v in saved_group.items() if k != "params"}}
        placed.update({pid: (p, loaded) for pid, p in zip(saved_group["params"], group["params"], strict=False)})
    return placed


def add_fallback_companions(optimizer: FusedOptimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """state_dict post-hook: each fallback's state gets placeholder scales and map (see the module)."""
    for pid, (param, group) in _placed(optimizer, state_dict).items():
        saved = state_dict["state"].get(pid)
        if saved is None or int8_fallback(param, group) is None:
            continue
        from torch.distributed.tensor import zeros  # a fallback is a DTensor: torch.distributed is there

        extra = {}
        for key in optimizer._state_keys:
            if isinstance(saved.get(key), torch.Tensor):
                blocks = -(-param.numel() // BLOCK)
                placements = scales_placements(tuple(param.placements))
                extra[key + SCALES] = zeros(blocks, device_mesh=param.device_mesh, placements=placements)
                extra[key + MAP] = fallback_map(param.device)
        state_dict["state"][pid] = {**saved, **extra}  # a new dict: the live state keeps no placeholder
    return state_dict


def _written(saved_map: Any) -> str:
    """What a refused fallback checkpoint has written: nothing, but DCP loads a legacy one (a str map) unchecked."""
    if isinstance(saved_map, torch.Tensor):
        return "nothing was written"
    return (
        "if DCP loaded this checkpoint (written before the placeholder tensors), it has cast those values into this "
        "optimizer's codes: build a new optimizer"
    )


def adapt_to_layout(optimizer: FusedOptimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict` with each state in the storage its param has here (see the module), or a ValueError."""
    if len(state_dict.get("param_groups", [])) != len(optimizer.param_groups):
        return state_dict  # torch's own error follows
    name = type(optimizer).__name__
    states = dict(state_dict["state"])
    for pid, (param, group) in _placed(optimizer, state_dict).items():
        saved = states.get(pid)
        if not isinstance(saved, dict) or not any(saved.get(k + MAP) is not None for k in optimizer._state_keys):
            continue
        fallback_here = int8_fallback(param, group) is not None
        saved = dict(saved)
        for slot, key in enumerate(optimizer._state_keys):
            saved_map = saved.get(key + MAP)
            if is_fallback_map(saved_map) and storage_of(param, group) == "int8":
                raise ValueError(
                    f"{name}.load_state_dict: {key} of param {pid} (shape {list(param.shape)}) was saved in fp32 "
                    "states (its FSDP2 shards were not block-aligned there), but its shards here are, so it would "
                    f"load as int8 codes; {_written(saved_map)}. Load this checkpoint at a layout where the param "
                    "falls back too (the saving one) and convert it there with state_convert.to_torch_state_dict / "
                    "from_torch_state_dict; docs/optimizer-states.md"
                )
            if not fallback_here or saved_map is None:
                continue
            scales, _ = saved.pop(key + SCALES, None), saved.pop(key + MAP)
            if not is_fallback_map(saved_map):  # int8 saved: codes and scales
                signed = optimizer._record.SIGNED[slot]
                if saved_map != map_name(signed) or not isinstance(scales, torch.Tensor):
                    raise ValueError(
                        f"{name}.load_state_dict: param {pid}: {key}{MAP} is {saved_map!r} (expected "
                        f"{map_name(signed)!r}) and {key}{SCALES} is {type(scales).__name__} (expected a tensor)"
                    )
                saved[key] = dequantize_shard(param, saved[key], scales, signed)
        states[pid] = saved
    return {**state_dict, "state": states}


def _local_flat_index(param: torch.Tensor) -> torch.Tensor:
    """The global row-major element index of each element of `param`'s local shard (int64, its local shape)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    index = torch.zeros(shape, dtype=torch.int64)
    for dim, (size, start) in enumerate(zip(shape, offset, strict=True)):
        along = (torch.arange(size, dtype=torch.int64) + start) * math.prod(param.shape[dim + 1 :])
        index += along.view([-1] + [1] * (len(shape) - dim - 1))
    return index


def dequantize_shard(param: torch.Tensor, codes: Any, scales: Any, signed: bool) -> torch.Tensor:
    """fp32 state of the DTensor `param` (sharded like it) from saved codes and scales over the global blocks:
    code value x its block's scale, in float32, as the step decodes it."""
    from torch.distributed.tensor import DTensor

    full_scales = scales.full_tensor() if is_sharded(scales) else scales  # every rank: a collective
    index = _local_flat_index(param)
    if is_sharded(codes) and codes.placements == param.placements:
        local_codes = codes.to_local()
    else:
        local_codes = (codes.full_tensor() if is_sharded(codes) else codes).reshape(-1)[index]
    local = param.to_local()
    values = code_values(signed).to(local.device)[local_codes.long().to(local.device)]
    values = values * full_scales.to(local.device, torch.float32)[(index // BLOCK).to(local.device)]
    return DTensor.from_local(
        values.contiguous(),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
