"""Picks the data-parallel strategy for a model once the setup has been validated (see base.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import LocalSync, SyncConfig
from .ddp import DDPOverlapSync, DDPSync
from .failures import watch_peers
from .fsdp import FSDP2Sync
from .validate import check_setup

__all__ = ["DDPOverlapSync", "DDPSync", "FSDP2Sync", "LocalSync", "grad_sync_for"]


def grad_sync_for(
    module: torch.nn.Module | None, params: Sequence[torch.nn.Parameter], config: SyncConfig
) -> LocalSync:
    """Validates the setup (no collective runs) and returns the strategy for it."""
    kind = check_setup(module, params, config)
    if kind != "local":
        watch_peers(config.peer_watch)  # one watch per process (peer_watch.py): the last data-parallel setting
    if kind == "ddp":
        sync = DDPOverlapSync if config.ddp_reduce == "overlap" else DDPSync
        return sync(module, config.comm_dtype)
    if kind in ("fsdp", "hsdp"):
        return FSDP2Sync(module, params, config.fsdp_reduce, hsdp=kind == "hsdp")
    return LocalSync()
