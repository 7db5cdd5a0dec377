"""How a fused optimizer stores its per-param state: `state_dtype` "fp32", "bf16" or "int8" (issue 30).

A param group's ``state_dtype`` and ``int8_min_numel`` (group keys, saved in the state_dict like lr)
decide each param's storage (`storage_of`):

* "fp32": float32 state (float64 for float64 params, whatever the group says);
* "bf16": bfloat16 state tensors, written with stochastic rounding by the op;
* "int8": blockwise dynamic quantization: ``<key>`` holds uint8 codes (the param's shape),
  ``<key>_scales`` one float32 absmax per block of 256 elements (ops/quant_maps.BLOCK), and
  ``<key>_map`` the code book's name (quant_maps.map_name), so a checkpoint says how to read its codes.
  Tensors with fewer than ``int8_min_numel`` elements keep fp32 states.

`expected_state_error` is the one check of a saved state against its param (load_state_dict runs it
over a whole checkpoint before writing anything).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..ops.constants import state_dtype
from ..ops.quant_maps import BLOCK, map_name
from .shards import is_sharded
from .state_shards import int8_fallback_reason, new_sharded_int8_state

STATE_DTYPES = ("fp32", "bf16", "int8")
DEFAULT_STATE_DTYPE = "fp32"
DEFAULT_INT8_MIN_NUMEL = 4096  # torchao's and bitsandbytes' threshold: smaller tensors keep fp32 states
SCALES, MAP = "_scales", "_map"  # suffixes of an int8 state's companion entries
CONVERT_HINT = "convert it with gradacc_ext.optim.state_convert.from_torch_state_dict(state_dict, optimizer)"


def check_state_options(owner: str, state_dtype: Any, int8_min_numel: Any) -> None:
    """ValueError naming the argument unless state_dtype is one of STATE_DTYPES and int8_min_numel an int >= 0."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"{owner}: state_dtype must be one of {STATE_DTYPES}, got {state_dtype!r}")
    if isinstance(int8_min_numel, bool) or not isinstance(int8_min_numel, int) or int8_min_numel < 0:
        raise ValueError(
            f"{owner}: int8_min_numel must be an int >= 0 (0: quantize every tensor), got {int8_min_numel!r}"
        )


def check_group_storage(owner: str, group: dict[str, Any]) -> None:
    """check_state_options on a param group's keys, and int8 states refused with amsgrad."""
    check_state_options(owner, group["state_dtype"], group["int8_min_numel"])
    if group["state_dtype"] == "int8" and group.get("amsgrad"):
        raise ValueError(
            f"{owner}: amsgrad=True is not supported with state_dtype='int8' (its max_exp_avg_sq would be "
            "re-quantized every step); use state_dtype='bf16' or 'fp32' for amsgrad"
        )


def storage_of(param: torch.Tensor, group: dict[str, Any]) -> str:
    """The storage of `param`'s state in `group`: "fp32", "bf16" or "int8". An FSDP2/HSDP param whose shards are
    not all block-aligned keeps fp32 states in an int8 group (state_shards.int8_fallback_reason says why)."""
    wanted = group["state_dtype"]
    if param.dtype == torch.float64 or (wanted == "int8" and param.numel() < group["int8_min_numel"]):
        return "fp32"
    if int8_fallback(param, group) is not None:
        return "fp32"
    return wanted


def int8_fallback(param: torch.Tensor, group: dict[str, Any]) -> str | None:
    """Why a param that its int8 group would quantize keeps fp32 states (an FSDP2/HSDP param whose shards are not
    all block-aligned: state_shards.int8_fallback_reason), or None."""
    if group["state_dtype"] != "int8" or param.dtype == torch.float64 or param.numel() < group["int8_min_numel"]:
        return None
    return int8_fallback_reason(param)


def scales_numel(param: torch.Tensor) -> int:
    return math.ceil(param.numel() / BLOCK)


def new_state(param: torch.Tensor, storage: str, key: str, signed: bool) -> dict[str, Any]:
    """A fresh zero state `key` for `param` in `storage`, with an int8 state's scales and map name.

    Fresh int8 state: codes and scales all 0 (any code decodes to 0 while its block's absmax is 0)."""
    if storage == "fp32":
        return {key: torch.zeros_like(param, dtype=state_dtype(param.dtype), memory_format=torch.contiguous_format)}
    if storage == "bf16":
        return {key: torch.zeros_like(param, dtype=torch.bfloat16, memory_format=torch.contiguous_format)}
    if is_sharded(param):  # DTensor codes and scales (an aligned param: storage_of)
        return new_sharded_int8_state(param, key, signed, key + SCALES, key + MAP)
    codes = torch.zeros_like(param, dtype=torch.uint8, memory_format=torch.contiguous_format)
    scales = torch.zeros(scales_numel(param), dtype=torch.float32, device=param.device)
    return {key: codes, key + SCALES: scales, key + MAP: map_name(signed)}


def stored_dtype(param: torch.Tensor, storage: str) -> torch.dtype:
    """The dtype a state tensor of `param` has in `storage`."""
    return {"fp32": state_dtype(param.dtype), "bf16": torch.bfloat16, "int8": torch.uint8}[storage]


def expected_state_error(
    param: torch.Tensor, storage: str, key: str, signed: bool, saved: dict[str, Any]
) -> str | None:
    """Why the saved state `key` (with its int8 companions) cannot be `param`'s in `storage`, or None."""
    value = saved.get(key)
    if not isinstance(value, torch.Tensor):
        if saved.get(key + SCALES) is not None:
            return f"{key}{SCALES} is given without {key}"
        return None
    if tuple(value.shape) != tuple(param.shape):
        return f"{key} has shape {list(value.shape)}, its param {list(param.shape)}"
    if storage == "int8":
        return _int8_error(param, key, signed, value, saved)
    if value.dtype == torch.uint8 or any(saved.get(key + suffix) is not None for suffix in (SCALES, MAP)):
        return f"{key} holds int8 codes, but this param's state storage is {storage!r}; {CONVERT_HINT}"
    if storage == "bf16" and value.dtype != torch.bfloat16:
        return f"{key} is {value.dtype}, but this param's state storage is 'bf16'; {CONVERT_HINT}"
    if not value.is_floating_point():
        return f"{key} is {value.dtype}, expected a floating-point state"
    return None


def _int8_error(param: torch.Tensor, key: str, signed: bool, codes: torch.Tensor, saved: dict[str, Any]) -> str | None:
    if codes.dtype != torch.uint8:
        return f"{key} is {codes.dtype}, but this param's state storage is 'int8' (uint8 codes); {CONVERT_HINT}"
    scales = saved.get(key + SCALES)
    if not isinstance(scales, torch.Tensor):
        return f"{key} holds int8 codes but {key}{SCALES} is missing"
    if scales.dtype != torch.float32 or scales.dim() != 1 or scales.numel() != scales_numel(param):
        return (
            f"{key}{SCALES} is {scales.dtype} {list(scales.shape)}, expected float32 [{scales_numel(param)}] "
            f"(one per {BLOCK} elements of a {param.numel()}-element param)"
        )
    if saved.get(key + MAP) != map_name(signed):
        return f"{key}{MAP} is {saved.get(key + MAP)!r}, expected {map_name(signed)!r}"
    return None


def state_storage_report(optimizer: Any) -> list[dict[str, int]] | None:
    """Per param group, the number of params whose state is in each storage (get_accumulation_stats()'s
    "optimizer_state_storage"); None for an optimizer without state_dtype (torch.optim's keep the param's dtype)."""
    report = getattr(optimizer, "state_storages", None)
    return report() if callable(report) else None


def state_fallback_report(optimizer: Any) -> list[dict[int, str]] | None:
    """Per param group, {param index: why} for the params an int8 group keeps in fp32 states because their FSDP2
    shards are not block-aligned (get_accumulation_stats()'s "optimizer_state_fallbacks"); None for an optimizer
    without state_dtype."""
    if "state_dtype" not in getattr(optimizer, "defaults", {}):
        return None
    return [
        {i: why for i, p in enumerate(group["params"]) if (why := int8_fallback(p, group)) is not None}
        for group in optimizer.param_groups
    ]


def with_fallbacks(text: str, optimizer: Any) -> str:
    """A fused optimizer's repr: torch's `text` (every group's keys, state_dtype among them), then each int8
    fallback with its reason."""
    notes = [
        f"    group {g} param {i} {list(optimizer.param_groups[g]['params'][i].shape)}: fp32 states, {why}\n"
        for g, reasons in enumerate(state_fallback_report(optimizer) or [])
        for i, why in reasons.items()
    ]
    return text if not notes else text.removesuffix(")") + "int8 fallbacks:\n" + "".join(notes) + ")"
