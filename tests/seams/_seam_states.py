"""The state_dtype dimension of the seam matrix: low-bit optimizer states (docs/optimizer-states.md).

A low-bit cell's plain loop runs the same fused optimizer with the same state_dtype and seed (low-bit states are not
fp32 states' bits). Its gradients are the run's up to fp32 summation order (ranks, micro-steps, the clip's norm), as
in every cell; a quantized state cannot absorb that last bit where a value sits on a rounding boundary: an int8 code
(or a bf16 state's stochastic rounding) goes the other way there, and the element's later values follow it. Such
flips are isolated (a value within an ulp of a boundary: in a sweep of 1,692 low-bit cells on these samples, at most
2 elements of a cell, in some DDP, FSDP2 and HSDP cells, none in one process), so a low-bit cell may differ from the
plain loop at under 1% of a tensor's elements; a seam that handled the states wrongly (a lost, repeated or skipped
step, a block's scale, a state reset at resume, another storage) moves whole blocks of 256 or every element.

The model's hidden layer is 512 wide for "int8_states", so that on 2 FSDP2 ranks (and HSDP's 2 shards) the first
Linear's shards are whole 256-element blocks and quantize as one process does, while the last Linear's ([3, 512]
and [3]) are not and keep fp32 states: the plain loop keeps those in an fp32-state group, and the run must name
each of them with its reason (optimizer_state_fallbacks), and no other.
"""

from __future__ import annotations

import torch
from _seam_table import FSDP_MODES, Cell

STATE_DTYPE = {"fp32_states": "fp32", "bf16_states": "bf16", "int8_states": "int8"}
INT8_HIDDEN = 512  # 512 x 5 weight rows and 512 biases split 256 | 256 rows on 2 shards: whole blocks
MESH_SHAPE = {"fsdp_window": (2,), "fsdp_micro": (2,), "hsdp": (2, 2)}  # as _seam_entries.wrap builds them


FLIP_SHARE = 0.01  # of a tensor's elements, for a low-bit cell (module docstring)


def boundary_flips_allowed(cell: Cell, numel: int) -> int:
    """How many elements of a tensor may differ from the plain loop: none with fp32 states."""
    return 0 if cell.state_dtype == "fp32_states" else int(numel * FLIP_SHARE)


def optimizer_options(cell: Cell) -> dict:
    """The fused optimizer's state keywords (none for fp32 states: the default, as every earlier cell ran)."""
    if cell.state_dtype == "fp32_states":
        return {}
    options = {"state_dtype": STATE_DTYPE[cell.state_dtype], "seed": 11}
    return options | ({"int8_min_numel": 0} if cell.state_dtype == "int8_states" else {})


def hidden_width(cell: Cell, default: int) -> int:
    return INT8_HIDDEN if cell.state_dtype == "int8_states" else default


def unaligned(cell: Cell, model: torch.nn.Module) -> dict[int, str]:
    """{param index: why} for the model's params (sharded or not) whose shards in the cell's FSDP2 layout keep
    fp32 states in an int8 group: computed from the global shapes and the mesh alone, as the optimizer does."""
    if cell.state_dtype != "int8_states" or cell.parallel not in FSDP_MODES:
        return {}
    from torch.distributed.tensor import Replicate, Shard

    from gradacc_ext.optim.state_shards import misalignment

    mesh = MESH_SHAPE[cell.parallel]
    placements = (Replicate(), Shard(0)) if len(mesh) == 2 else (Shard(0),)
    reasons = {i: misalignment(tuple(p.shape), mesh, placements) for i, p in enumerate(model.parameters())}
    return {i: why for i, why in reasons.items() if why is not None}


def reference_params(cell: Cell, model: torch.nn.Module) -> list:
    """The plain loop's param groups: one, or the params that fall back in the cell's layout in an fp32 group."""
    params, fallback = list(model.parameters()), unaligned(cell, model)
    if not fallback:
        return params
    return [
        {"params": [p for i, p in enumerate(params) if i not in fallback]},
        {"params": [p for i, p in enumerate(params) if i in fallback], "state_dtype": "fp32"},
    ]


def storage_problem(cell: Cell, model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """ "" when the run's int8 fallbacks are the params the layout cannot quantize, each with its reason, else what
    differs (the state tensors' dtypes are compared with the plain loop's by _seam_groups._compare)."""
    if cell.state_dtype != "int8_states":
        return ""
    from gradacc_ext.optim.state_storage import state_fallback_report

    inner = getattr(opt, "optimizer", opt)  # Accelerate's AcceleratedOptimizer holds the optimizer
    (got,) = state_fallback_report(inner)  # one group: its indices are the model's
    want = unaligned(cell, model)
    if got != want:
        return f"int8 fallbacks {got}, the layout's unaligned params are {want}"
    return ""
