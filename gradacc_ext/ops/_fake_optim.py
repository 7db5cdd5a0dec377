"""Fake (meta) kernels of the fused optimizer steps: the same checks as csrc/binding_optim.cpp."""

from __future__ import annotations

import torch

from . import _checks_optim


def register() -> None:
    @torch.library.register_fake("gradacc::adamw_step_")
    def _adamw_step(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps, lr, lr_tensor, grad_mult,
        found_inf, beta1, beta2, eps, weight_decay, maximize, param_mode, seed,
    ) -> None:  # fmt: skip
        _checks_optim.check_adamw_step(
            "gradacc.adamw_step_", params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps, lr,
            lr_tensor, grad_mult, found_inf, beta1, beta2, eps, weight_decay, param_mode,
        )  # fmt: skip

    @torch.library.register_fake("gradacc::sgd_step_")
    def _sgd_step(
        params, grads, momentum_buffers, master_params, steps, lr, lr_tensor, grad_mult, found_inf, momentum,
        dampening, weight_decay, nesterov, maximize, param_mode, seed,
    ) -> None:  # fmt: skip
        _checks_optim.check_sgd_step(
            "gradacc.sgd_step_", params, grads, momentum_buffers, master_params, steps, lr, lr_tensor, grad_mult,
            found_inf, momentum, dampening, weight_decay, nesterov, param_mode,
        )  # fmt: skip
