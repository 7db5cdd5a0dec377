"""Which calls of a fused nn.Linear the fusion serves; the others run plain F.linear, as nn.Linear would.

The fused node (linear_fusion._FusedLinear) is an autograd.Function with a backward only, written for
the accumulator's own parameters and dense inputs. A call it cannot serve runs `F.linear(input,
module.weight, module.bias)`, which is exactly nn.Linear.forward, and is counted per reason in
`stats.linear_fusion_unfused_calls`:

- a torch.func transform is active (vmap, grad, jvp, jacrev, the per-sample-gradient recipe): the
  Function has no setup_context/vmap rule, and functorch's wrapped tensors are not the buffers' business;
- weight or bias is not the parameter the accumulator was given: torch.func.functional_call (EMA
  weights, per-sample gradients), torch.nn.utils.parametrize, or a parameter replaced for good; the
  gradient goes to the tensor the call used, as with nn.Linear;
- forward-mode AD (a dual tensor): the Function has no jvp;
- an input that is not a plain dense tensor (a tensor subclass, a nested tensor): F.linear's own rules.

Exactness: an unfused call hands autograd an ordinary gradient. Where that gradient is an owned
parameter's (vmap(model), a parametrization of the owned weight, a dual input), autograd puts it in
.grad and the post-accumulate hook (hooks.py) folds it into the same view the fused calls write
directly; the buffers' per-parameter `seen` decides assign or add for both, so a micro-step that mixes
fused and unfused calls counts each contribution once, whichever lands first.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)


def unfused_reason(
    x: object,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    owned_weight: nn.Parameter,
    owned_bias: nn.Parameter | None,
) -> str | None:
    """Why this call of a fused Linear must run plain F.linear, or None when the fused node serves it."""
    # torch's own check (autograd.Function.apply, FSDP2) for vmap/grad/jvp/jacrev being active.
    if torch._C._are_functorch_transforms_active():
        return "a torch.func transform (vmap, grad, jvp, ...) is active"
    if weight is not owned_weight or bias is not owned_bias:
        return (
            "weight or bias is not the parameter the accumulator was given (torch.func.functional_call, "
            "a parametrization, or a replaced parameter): its gradient goes to the tensor the call used"
        )
    if type(x) not in _PLAIN_TENSORS:
        return f"the input is a {type(x).__name__}, not a plain torch.Tensor"
    if x.is_nested:
        return "the input is a nested tensor"
    if _has_tangent((x, weight, bias)):
        return "forward-mode AD (a dual tensor): the fused node has no jvp"
    return None


def _has_tangent(tensors: tuple[torch.Tensor | None, ...]) -> bool:
    # unpack_dual costs about a microsecond a tensor; with no dual level open (forward_ad's own test) none has one.
    return fwAD._current_level >= 0 and any(fwAD.unpack_dual(t).tangent is not None for t in tensors if t is not None)
