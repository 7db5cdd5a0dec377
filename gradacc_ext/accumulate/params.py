"""Which parameters an accumulator owns: the trainable ones of a model or of an iterable, each once."""

from __future__ import annotations

from typing import Any

import torch


def trainable(model_or_params: torch.nn.Module | Any) -> tuple[torch.nn.Module | None, list[torch.nn.Parameter]]:
    """(the module or None, its trainable parameters); frozen ones are excluded and shared ones counted once."""
    if isinstance(model_or_params, torch.nn.Module):
        module, params = model_or_params, list(model_or_params.parameters())
    elif isinstance(model_or_params, torch.Tensor):
        raise TypeError("GradientAccumulator: model_or_params must be an nn.Module or an iterable of parameters")
    else:
        module = None
        try:
            params = list(model_or_params)
        except TypeError:
            raise TypeError(
                "GradientAccumulator: model_or_params must be an nn.Module or an iterable of parameters, "
                f"got {type(model_or_params).__name__}"
            ) from None
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"GradientAccumulator: params[{i}] is a {type(p).__name__}, expected a tensor")
    trainable_params = list({id(p): p for p in params if p.requires_grad}.values())
    if not trainable_params:
        raise ValueError("GradientAccumulator: no trainable parameters (all have requires_grad=False)")
    return module, trainable_params
