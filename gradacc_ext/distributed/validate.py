"""Checks a data-parallel setup before any collective runs, so a bad input fails on every rank alike.

Every check here reads only local state (the model, its parameters, the
mesh object, the config, whether a process group exists), so each rank
raises the same error at construction and none is left waiting in a
collective for a peer that already failed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel

from ..ops.constants import HALF_DTYPES
from .base import SyncConfig

PLACEMENTS = {"fsdp": (Shard(0),), "hsdp": (Replicate(), Shard(0))}


def _names(module: torch.nn.Module | None, params: Sequence[torch.nn.Parameter]) -> list[str]:
    named = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
    return [named.get(id(p), f"params[{i}]") for i, p in enumerate(params)]


def _require_process_group(what: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"GradientAccumulator: {what} needs torch.distributed, but no process group is initialised; "
            "call torch.distributed.init_process_group() (e.g. under torchrun) before building the accumulator"
        )


def check_setup(module: torch.nn.Module | None, params: Sequence[torch.nn.Parameter], config: SyncConfig) -> str:
    """Returns "local", "ddp", "fsdp" or "hsdp"; raises a clear error for a setup that cannot work."""
    sharded = [isinstance(p, DTensor) for p in params]
    _refuse_fsdp1(module)
    if isinstance(module, DistributedDataParallel):
        _require_process_group("a DistributedDataParallel model")
        kind, world = "ddp", dist.get_world_size(module.process_group)
    elif any(sharded):
        kind, world = _check_sharded(module, params, sharded, config)
    else:
        if config.world_size > 1:
            _require_process_group(f"config.world_size={config.world_size}")
        kind, world = "local", config.world_size
    if config.ddp_reduce == "overlap" and kind != "ddp":
        raise ValueError(
            "GradientAccumulationConfig.ddp_reduce='overlap' needs a DistributedDataParallel model; "
            f"this one is {kind!r}: use ddp_reduce='buffer' (the default)"
        )
    if config.comm_dtype is not None and kind != "ddp":
        raise ValueError(
            f"GradientAccumulationConfig.comm_dtype applies to DistributedDataParallel models; this one is {kind!r}"
            + (": FSDP2 reduces in MixedPrecisionPolicy(reduce_dtype=...)" if kind in ("fsdp", "hsdp") else "")
        )
    if config.ddp_reduce == "overlap" and config.accum_dtype is not None:
        names = _names(module, params)
        low = [(n, p.dtype) for n, p in zip(names, params, strict=True) if p.dtype in HALF_DTYPES]
        if low:
            raise ValueError(
                f"GradientAccumulationConfig.ddp_reduce='overlap' hands the buffers to DDP as param.grad, so they must "
                f"have the parameters' dtype, but {low[0][0]} is {low[0][1]} with accum_dtype={config.accum_dtype}: "
                "use ddp_reduce='buffer' (fp32 accumulation, reduced once), or accum_dtype=None"
            )
    _check_world(config, world, kind)
    return kind


def _refuse_fsdp1(module: torch.nn.Module | None) -> None:
    """FSDP1 (FullyShardedDataParallel) shards flat parameters that are plain tensors: taken for one process, the
    window's norm, clip and found_inf would be one rank's, silently wrong under clipping. Refused by name."""
    wrapped = [name or "the model" for name, m in (module.named_modules() if module is not None else [])
               if isinstance(m, FullyShardedDataParallel)]  # fmt: skip
    if wrapped:
        raise TypeError(
            f"GradientAccumulator: {wrapped[0]} is wrapped in FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel), "
            "which is not supported: its flat parameters look like one process's, so the window's norm and found_inf "
            "would be one rank's. Shard the model with FSDP2's fully_shard (torch.distributed.fsdp.fully_shard; "
            "Accelerate: FullyShardedDataParallelPlugin(fsdp_version=2)), or use DistributedDataParallel"
        )


def _check_sharded(
    module: torch.nn.Module | None,
    params: Sequence[torch.nn.Parameter],
    sharded: list[bool],
    config: SyncConfig,
) -> tuple[str, int]:
    names = _names(module, params)
    if not all(sharded):
        plain = [n for n, s in zip(names, sharded, strict=True) if not s]
        raise TypeError(
            "GradientAccumulator: some trainable parameters are DTensors (FSDP2 shards) and some are plain tensors "
            f"({', '.join(plain[:4])}{' ...' if len(plain) > 4 else ''}); one accumulator needs all of them "
            "sharded: apply fully_shard to the root module too, or freeze the plain ones"
        )
    if module is None or not any(isinstance(m, FSDPModule) for m in module.modules()):
        raise TypeError(
            "GradientAccumulator: DTensor parameters are supported when they come from FSDP2's fully_shard; "
            "pass the fully_shard-ed model (not an iterable of its parameters)"
        )
    _require_process_group("an FSDP2 (fully_shard) model")
    mesh = params[0].device_mesh
    for name, p in zip(names, params, strict=True):
        if p.device_mesh != mesh:
            raise ValueError(
                f"GradientAccumulator: parameter {name} lives on another device mesh than {names[0]}; "
                "shard the whole model on one mesh"
            )
    found = tuple(params[0].placements)
    kind = next((k for k, placements in PLACEMENTS.items() if placements == found), None)
    wanted = config.sharding if config.sharding != "auto" else kind
    if kind is None or kind != wanted or any(tuple(p.placements) != found for p in params):
        need = wanted or "fsdp"
        shape = "(replicas, shards), mesh_dim_names=(...)" if need == "hsdp" else "(world,)"
        raise ValueError(
            f"GradientAccumulator: sharding={config.sharding!r} needs a {len(PLACEMENTS[need])}-D mesh with placements "
            f"{PLACEMENTS[need]} ({'replicate x shard' if need == 'hsdp' else 'shard'}); the model's mesh has "
            f"{mesh.ndim} dim(s) {mesh.mesh_dim_names or ''} and placements {found}: build the mesh with "
            f"init_device_mesh(device, {shape}) for "
            f"fully_shard, or set GradientAccumulationConfig.sharding to {kind or 'the mesh you built'!r}"
        )
    if mesh.size() != dist.get_world_size():
        raise ValueError(
            f"GradientAccumulator: the FSDP2 mesh spans {mesh.size()} ranks but the process group has "
            f"{dist.get_world_size()}; shard over the whole world (other parallelisms are not supported)"
        )
    return kind, mesh.size()


def _check_world(config: SyncConfig, world: int, kind: str) -> None:
    """A planned effective batch (target_batch_size, or world_size given) must match the ranks taking part."""
    if kind == "local" or config.world_size == world or (config.world_size == 1 and config.target_batch_size is None):
        return
    hint = ""
    if config.target_batch_size is not None and config.micro_batch_size is not None:
        per_step = config.micro_batch_size * world
        if config.target_batch_size % per_step:
            hint = (
                f"; target_batch_size={config.target_batch_size} is not a multiple of micro_batch_size * {world} = "
                f"{per_step} either: change the target or the micro-batch size (plan_accumulation picks one)"
            )
    raise ValueError(
        f"GradientAccumulationConfig.world_size={config.world_size}, but the {kind} model runs data-parallel over "
        f"{world} ranks: set world_size={world} so the planned effective batch is right{hint}"
    )
