"""fused_step_for finds gradacc's fused optimizers by their base class: a new one is listed nowhere."""

from __future__ import annotations

import torch

from gradacc_ext.optim import FusedSGD, fused_step_for
from gradacc_ext.optim._fused import FusedOptimizer


class _Unlisted(FusedOptimizer):
    """A fused optimizer no module names: FusedSGD's state and op under a new class."""

    _state_keys, _record, _op = FusedSGD._state_keys, FusedSGD._record, FusedSGD._op
    _init_state, _used_keys, _options = FusedSGD._init_state, FusedSGD._used_keys, FusedSGD._options

    def __init__(self, params) -> None:
        defaults = {"lr": 0.1, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False,
                    "maximize": False}  # fmt: skip
        super().__init__(params, defaults, max_grad_norm=None, param_mode="nearest", seed=0, backend="torch")


def test_a_new_fused_optimizer_takes_the_fused_step_unlisted():
    param = torch.nn.Parameter(torch.randn(5, generator=torch.Generator().manual_seed(3)))
    before = param.detach().clone()
    grad = torch.randn(5, generator=torch.Generator().manual_seed(4))
    step = fused_step_for(_Unlisted([param]), [param], "torch")
    assert not isinstance(step, str), step
    step({param: grad}, None, None)
    torch.testing.assert_close(param.detach(), before - 0.1 * grad, rtol=0, atol=1e-7)
    assert step.calls == 1


def test_a_foreign_optimizer_is_refused_naming_the_fused_ones():
    param = torch.nn.Parameter(torch.ones(2))
    why = fused_step_for(torch.optim.RMSprop([param]), [param], "torch")
    assert why.startswith("RMSprop is not FusedAdamW, FusedLion, FusedSGD")
    assert why.endswith("or torch.optim.AdamW / Adam / SGD")
