"""Fused steps over FSDP2's sharded parameters: the op runs on every DTensor argument's local shard.

Under fully_shard (and HSDP) a parameter, its gradient and torch's optimizer state are DTensors
sharded alike, so the element-wise step of the local shards is the local shard of the step: the
op writes the rank's shards in place and the state stays a DTensor (torch's format, which
torch.distributed.checkpoint saves). Uneven and empty shards are plain (possibly empty) tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

import torch


def is_sharded(tensor: Any) -> bool:
    """A DTensor (FSDP2/HSDP), told by its type's name so that torch.distributed need not be importable."""
    return isinstance(tensor, torch.Tensor) and type(tensor).__name__ == "DTensor"


def local_shard(tensor: Any) -> Any:
    """A DTensor's local shard (a view: in-place writes reach the DTensor); anything else as it is."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def on_local_shards(op: Callable[..., Any]) -> Callable[..., Any]:
    """`op` with the DTensors in its tensor-list arguments (params, grads, state) replaced by their local shards."""

    @wraps(op)
    def run(*args: Any, **kwargs: Any) -> Any:
        args = tuple(_shards(a) for a in args)
        return op(*args, **{k: _shards(v) for k, v in kwargs.items()})

    return run


def _shards(arg: Any) -> Any:
    if isinstance(arg, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in arg):
        return [local_shard(t) for t in arg]
    return arg  # scalars, tensors (lr, grad_mult, found_inf: never sharded) and tuples of numbers (betas)
