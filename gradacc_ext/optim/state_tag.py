"""A torch.distributed.checkpoint (DCP) checkpoint loads only into param groups that store their states as the
saving groups did: anything else is refused in DCP's load planning, before anything is read or written.

DCP loads into the loading state_dict's own tensors -- the optimizer's live states -- in place, casting what it
reads to their dtype, and its planning (the one step before it writes) compares keys, sizes and tensor-or-not
only: a param's fp32, bf16 and int8 ``exp_avg`` have the same key and size. So in a state_dict each group's
``state_dtype`` is a zero-element tensor (`storage_tag`) whose SHAPE says how the group stores its states:

    [0, s, n, k]   s: STATE_DTYPES.index(state_dtype) (0 fp32, 1 bf16, 2 int8), n: the group's params,
                   k: those that keep fp32 states although the group says bf16 / int8 (float64 params, int8
                   tensors under int8_min_numel)

Different shapes: DCP's planner refuses ("Size mismatch between saved torch.Size([...]) and current: ... for
<prefix>.param_groups.<g>.state_dtype"). Per param, beyond the group: an int8 state's ``<key>_scales`` and
``<key>_map`` (a str) make a checkpoint without them, or with a fallback's placeholder map (a tensor), refused
too (state_reshard.py); FSDP2 fallbacks count as int8 here, since an int8 state loads into one (dequantized).

`read_storage_tags` turns the tags back into names at load_state_dict. The tag takes the name's key, not a new
one, so that checkpoints from before the tags still load: DCP refuses a key its checkpoint lacks ("Missing key"),
but replaces the loading tag with the name saved at this one (a bytes entry), unchecked -- such a checkpoint in
another storage is refused (state_load.check_loadable) only after DCP has written its values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .state_storage import STATE_DTYPES, int8_fallback, storage_of

if TYPE_CHECKING:
    from ._fused import FusedOptimizer

TAG_DIMS = 4  # [0, s, n, k]


def storage_tag(group: dict[str, Any]) -> torch.Tensor:
    """The zero-element tensor of shape [0, s, n, k] that stands for `group`'s state_dtype in a state_dict."""
    params = group["params"]
    kept = sum(1 for p in params if storage_of(p, group) != group["state_dtype"] and int8_fallback(p, group) is None)
    return torch.empty(0, STATE_DTYPES.index(group["state_dtype"]), len(params), kept)


def add_storage_tags(optimizer: FusedOptimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """state_dict post-hook (after state_reshard's, which reads the names): each group's state_dtype as its tag."""
    for saved, group in zip(state_dict["param_groups"], optimizer.param_groups, strict=True):
        saved["state_dtype"] = storage_tag(group)
    return state_dict


def read_storage_tags(optimizer: FusedOptimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict` with each group's state_dtype tag (see the module) back to its name; a ValueError naming the
    group unless a tensor there is a tag. Names (a checkpoint from before the tags, torch's form) pass as they are."""
    groups = []
    for g, saved in enumerate(state_dict.get("param_groups", [])):
        tag = saved.get("state_dtype")
        if isinstance(tag, torch.Tensor):
            shape = tuple(tag.shape)
            if len(shape) != TAG_DIMS or shape[0] != 0 or not shape[1] < len(STATE_DTYPES):
                raise ValueError(
                    f"{type(optimizer).__name__}.load_state_dict: param_groups[{g}]['state_dtype'] is a tensor of "
                    f"shape {list(shape)}, expected a name in {STATE_DTYPES} or a storage tag [0, s, n, k] with "
                    f"s < {len(STATE_DTYPES)} (gradacc_ext.optim.state_tag)"
                )
            saved = {**saved, "state_dtype": STATE_DTYPES[shape[1]]}
        groups.append(saved)
    return {**state_dict, "param_groups": groups}
