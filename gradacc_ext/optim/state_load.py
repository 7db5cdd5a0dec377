"""Loading a fused optimizer's checkpoint: every state checked against its param before anything is written,
then re-read exactly in its storage (torch's loader would cast uint8 codes and float32 scales to the param's
dtype).

The storage a saved state must be in is the one the loaded optimizer will use: the checkpoint's group keys
(``state_dtype``, ``int8_min_numel``), or this optimizer's defaults for a checkpoint without them (a
torch.optim one), exactly as ``__setstate__`` fills them in after loading.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .state_storage import MAP, SCALES, expected_state_error, storage_of, stored_dtype

if TYPE_CHECKING:
    from ._fused import FusedOptimizer


def check_loadable(optimizer: FusedOptimizer, state_dict: dict[str, Any]) -> None:
    """ValueError naming the param (group, index) and the state key unless every saved state fits its param.

    A checkpoint whose groups do not line up with the optimizer's is left to torch's own error."""
    name = type(optimizer).__name__
    saved_groups = state_dict.get("param_groups", [])
    if len(saved_groups) != len(optimizer.param_groups) or any(
        len(saved["params"]) != len(group["params"])
        for saved, group in zip(saved_groups, optimizer.param_groups, strict=True)
    ):
        return
    states = state_dict.get("state", {})
    for g, (saved_group, group) in enumerate(zip(saved_groups, optimizer.param_groups, strict=True)):
        loaded = {**optimizer.defaults, **{k: v for k, v in saved_group.items() if k != "params"}}
        optimizer.check_group(loaded)
        for i, (pid, param) in enumerate(zip(saved_group["params"], group["params"], strict=True)):
            saved = states.get(pid)
            if not isinstance(saved, dict):
                continue
            storage = storage_of(param, loaded)
            for slot, key in enumerate(optimizer._state_keys):
                why = expected_state_error(param, storage, key, optimizer._record.SIGNED[slot], saved)
                if why is not None:
                    raise ValueError(f"{name}.load_state_dict: param {i} of group {g}: {why}")


def adopt_state(
    state: dict[str, Any], param: torch.Tensor, storage: str, keys: tuple[str, ...], saved: dict[str, Any]
) -> None:
    """Re-reads `saved` (checked by check_loadable) into `state` in the param's storage, on its device."""
    for key in keys:
        if isinstance(saved.get(key), torch.Tensor):
            state[key] = saved[key].to(device=param.device, dtype=stored_dtype(param, storage), copy=True)
            if storage == "int8":
                state[key + SCALES] = saved[key + SCALES].to(device=param.device, dtype=torch.float32, copy=True)
                state[key + MAP] = saved[key + MAP]  # torch's loader iterates a str into a generator's repr
    if isinstance(saved.get("master_param"), torch.Tensor):
        state["master_param"] = saved["master_param"].to(device=param.device, dtype=torch.float32, copy=True)
    if "step" in saved:
        step = saved["step"]
        value = step if isinstance(step, torch.Tensor) else torch.tensor(float(step))
        state["step"] = value.to(device=param.device, dtype=torch.float32, copy=True).reshape(())
