"""Which parameters an accumulator owns: the trainable ones of a model or of an iterable, each once."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..optim.shards import is_sharded


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


def check_optimizer(module: torch.nn.Module | None, params: list[torch.nn.Parameter], optimizer) -> None:
    """The optimizer must hold the trainable parameters: none of them is an error (the model would never
    train), some of them a warning (the others accumulate gradients that no step uses)."""
    clip = getattr(optimizer, "max_grad_norm", None)  # gradacc's fused optimizers clip inside their step
    if clip is not None and any(is_sharded(p) for p in params):
        # Refused here, on every rank, rather than by the optimizer at the end of the first window.
        raise ValueError(
            f"GradientAccumulator: {type(optimizer).__name__}(max_grad_norm={clip}) would clip by this rank's "
            f"FSDP2 shards' norm only; build it without max_grad_norm and set "
            f"GradientAccumulationConfig(max_grad_norm={clip}): the accumulator clips by the global norm"
        )
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [p for p in params if id(p) not in held]
    if not missing:
        return
    names = {id(p): f"#{i}" for i, p in enumerate(params)}
    names.update({id(p): n for n, p in module.named_parameters()} if module is not None else {})
    what = "the model" if module is not None else "model_or_params"
    if len(missing) == len(params):
        raise ValueError(
            f"GradientAccumulator: the optimizer holds none of the {len(params)} trainable parameters of {what} "
            f"(it holds {len(held)} other tensors); build it over the same parameters, e.g. "
            "torch.optim.AdamW(model.parameters())"
        )
    listed = ", ".join(names[id(p)] for p in missing[:5])
    warnings.warn(
        f"GradientAccumulator: {len(missing)} of the {len(params)} trainable parameters of {what} are not in the "
        f"optimizer ({listed}{', ...' if len(missing) > 5 else ''}): they accumulate gradients that no optimizer "
        "step uses. Freeze them (requires_grad_(False)) or add them to the optimizer",
        UserWarning,
        stacklevel=5,  # the user line of the usual GradientAccumulator(model, optimizer, config) call
    )
