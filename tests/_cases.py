"""Models, data, the plain full-batch loop and tolerances shared by the accumulator tests (single process and
data parallel): a small MLP, random (and padded token) batches, and the reference each test compares against."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gradacc_ext.ops
from gradacc_ext import GradientAccumulator

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-6)}
IN, HIDDEN, OUT = 5, 7, 3


def make_model(dtype: torch.dtype, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT)).to(dtype)


def make_batches(n: int, size: int, dtype: torch.dtype, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, IN, generator=g, dtype=dtype), torch.randn(size, OUT, generator=g, dtype=dtype))
        for _ in range(n)
    ]


def make_optimizer(kind: str, params, fused: bool = False, dtype: torch.dtype = torch.float32) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    # Adam divides by sqrt(v) + eps: in fp32 a near-zero gradient element whose sign is set by
    # summation-order rounding moves by up to lr either way. eps=1e-3 bounds that amplification
    # (by 1/eps) so fp32 runs are comparable; float64 runs keep torch's default eps.
    eps = 1e-3 if dtype == torch.float32 else 1e-8
    return torch.optim.AdamW(params, lr=0.02, weight_decay=0.05, eps=eps, **({"fused": True} if fused else {}))


def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def mse(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def reference_run(model, optimizer, scheduler, batches, n, max_norm=None, norm_type=2.0, short_weight=None):
    """The plain full-batch loop: each window's micro-batches concatenated into one batch.

    short_weight="k/N" reproduces the Accelerate/Lightning bug (the short last
    window's gradient scaled by k/N) so tests can show it is detected.
    """
    for start in range(0, len(batches), n):
        window = batches[start : start + n]
        x, y = torch.cat([b[0] for b in window]), torch.cat([b[1] for b in window])
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        if short_weight == "k/N":
            loss = loss * len(window) / n
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def accumulator_run(acc: GradientAccumulator, batches, loss_fn=mse) -> list[bool]:
    closed = []
    for batch in batches:
        with acc.micro_step():
            closed.append(acc.backward(loss_fn(acc.module, batch)))
    closed.append(acc.flush())
    return closed


def assert_params_close(a: torch.nn.Module, b: torch.nn.Module, dtype: torch.dtype) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOL[dtype], msg=lambda m, name=name: f"{name}: {m}")


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def padded_batches(n: int, seed: int, dtype: torch.dtype, max_len: int = 9):
    """Variable-length, padded token batches: (x, y, mask) with very different token counts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        size = int(torch.randint(1, 5, (1,), generator=g))
        lengths = torch.randint(1, max_len + 1, (size,), generator=g)
        mask = (torch.arange(max_len)[None, :] < lengths[:, None]).to(dtype)
        x = torch.randn(size, max_len, IN, generator=g, dtype=dtype)
        y = torch.randn(size, max_len, OUT, generator=g, dtype=dtype)
        out.append((x, y, mask))
    return out


def token_sum(model, batch) -> torch.Tensor:
    x, y, mask = batch
    return (((model(x) - y) ** 2).sum(-1) * mask).sum()


class OpCounter:
    """Wraps ops.global_norm and ops.accumulate_final_: the bytes the norm pass read, the last fold's calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.norm_bytes = 0
        self.norm_calls = 0
        self.final_calls = 0
        norm, final = gradacc_ext.ops.global_norm, gradacc_ext.ops.accumulate_final_

        def counted_norm(tensors, *args, **kwargs):
            tensors = list(tensors)
            self.norm_calls += 1
            self.norm_bytes += sum(t.numel() * t.element_size() for t in tensors)
            return norm(tensors, *args, **kwargs)

        def counted_final(*args, **kwargs):
            self.final_calls += 1
            return final(*args, **kwargs)

        monkeypatch.setattr(gradacc_ext.ops, "global_norm", counted_norm)
        monkeypatch.setattr(gradacc_ext.ops, "accumulate_final_", counted_final)


class FailInBackward(torch.autograd.Function):
    """Identity in forward; its backward raises (a failure after part of the gradient may have been folded)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("injected")


class OOMInBackward(torch.autograd.Function):
    """Identity in forward; its backward raises torch.OutOfMemoryError, counted on `owner.ooms` when given."""

    @staticmethod
    def forward(ctx, x, owner=None):
        ctx.owner = owner
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.owner is not None:
            ctx.owner.ooms += 1
        raise torch.OutOfMemoryError("injected in backward")
