"""config.gradient_accumulation_fusion: every trainable nn.Linear writes its weight gradient into its buffer view.

Without it, autograd's weight-gradient GEMM writes a fresh dW each micro-step, the hooks (hooks.py) add it
into the buffer and free it: an extra pass over every weight and a transient dW (a bf16 dW for bf16
params, so the fp32 sum adds rounded values). With it, each Linear's backward runs

    view.addmm_(grad_out_2d.T, input_2d, beta=0 or 1, alpha=w)      # fp32/fp64 params, any device
    gradacc.wgrad_addmm_(view, grad_out_2d.T, input_2d, beta, alpha)  # bf16/fp16 params, fp32 buffer, CUDA

and returns no weight gradient to autograd (Megatron-LM's gradient_accumulation_fusion). beta=0 (assign,
no zeroing pass) when the view has received nothing yet this window: WindowSums.write_directly hands
out the view and its beta (window_sums.py, shared with the hooks path), so a tied weight whose other contribution
(an embedding's) arrives first through the hooks is added to, and lands in one view, counted once. The
bias gradient is summed into its view (a bias-sized temporary). w is the micro-step's weight
(normalisation, num_items), scaled into grad_out when it is a device tensor.

Hook-in: while the accumulator owns the model, each eligible nn.Linear gets an instance attribute
`forward` (the class's forward is untouched; close() deletes the attribute, so the model is exactly as
before), which checks that the Linear still holds the parameters it was given and applies _FusedLinear.
Everything else goes through the hooks path unchanged: the recomputed forward of activation
checkpointing builds a new _FusedLinear node; a backward outside the accumulator (retain_graph,
gradient penalties) gets an ordinary weight gradient in .grad that the next micro-step counts; a
graph torch.compile traces (torch.compiler.is_compiling()) calls plain F.linear, so its gradients go
through the hooks, and a torch.compile'd model (OptimizedModule) is not fused at all (reason given).
Per-parameter fallbacks (reason logged once and kept in stats): a Linear subclass with its own forward,
bf16/fp16 params without a mixed-dtype GEMM (CPU; a failed CUDA probe), FSDP2 DTensor params.
"""

from __future__ import annotations

import logging
import sys
import types
import warnings
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import wgrad
from ..ops.constants import HALF_DTYPES
from .hooks import GradHooks
from .linear_fusion_calls import unfused_reason
from .stats import AccumulatorStats

log = logging.getLogger(__name__)


class _Slot:
    """One fused Linear's buffer slots: where its weight and bias gradients go."""

    def __init__(self, owner: weakref.ref, weight: int, bias: int | None, mixed_gemm: bool) -> None:
        self.owner, self.weight, self.bias, self.mixed_gemm = owner, weight, bias, mixed_gemm

    def weight_grad(self, g2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor | None:
        """Writes alpha * g2^T @ x2 into the weight's view; returns it to autograd instead when not armed."""
        hooks = self._armed_hooks()
        if hooks is None:
            return g2.t().mm(x2)
        view, beta = hooks.sums.write_directly(self.weight)  # allocates the buffers on a window's first write
        g2, alpha = _weighted(g2, hooks.weight)
        if g2.dtype == view.dtype:
            view.addmm_(g2.t(), x2, beta=beta, alpha=alpha)
        elif self.mixed_gemm:
            wgrad.wgrad_addmm_(view, g2.t(), x2, beta, alpha)
        else:  # autocast activations over fp32 params on CPU: the products in the buffer's precision
            view.addmm_(g2.t().to(view.dtype), x2.to(view.dtype), beta=beta, alpha=alpha)
        return None

    def bias_grad(self, g2: torch.Tensor) -> torch.Tensor | None:
        hooks = self._armed_hooks()
        if self.bias is None or hooks is None:
            return g2.sum(0)
        view, beta = hooks.sums.write_directly(self.bias)
        g2, alpha = _weighted(g2, hooks.weight)
        total = g2.sum(0, dtype=view.dtype)
        if beta:
            view.add_(total, alpha=alpha)
        else:
            torch.mul(total, alpha, out=view)
        return None

    def _armed_hooks(self) -> GradHooks | None:
        fusion = self.owner()
        return fusion.hooks if fusion is not None and fusion.hooks.armed else None


def _weighted(g2: torch.Tensor, weight: float | torch.Tensor) -> tuple[torch.Tensor, float]:
    # addmm takes a host scalar alpha; a device weight (num_items as a tensor) scales grad_out instead.
    return (g2 * weight, 1.0) if isinstance(weight, torch.Tensor) else (g2, float(weight))


class _FusedLinear(torch.autograd.Function):
    """F.linear whose backward hands the weight and bias gradients to a _Slot (None to autograd when armed)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slot: _Slot) -> torch.Tensor:
        device = x.device.type
        if torch.is_autocast_enabled(device):  # the casts autocast would make for F.linear
            dtype = torch.get_autocast_dtype(device)
            x, weight, bias = (t if t is None or t.dtype == torch.float64 else t.to(dtype) for t in (x, weight, bias))
        with torch.autocast(device, enabled=False):
            out = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.slot = slot
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_out.matmul(weight) if need_x else None
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_w = ctx.slot.weight_grad(g2, x.reshape(-1, x.shape[-1])) if need_w else None
        grad_b = ctx.slot.bias_grad(g2) if need_b else None
        return grad_x, grad_w, grad_b, None


class _FusedForward:
    """The instance `forward` of a fused nn.Linear (holds the fusion weakly: GradHooks' ownership pattern)."""

    def __init__(self, module: nn.Linear, name: str, slot: _Slot) -> None:
        self.module_ref, self.name, self.slot = weakref.ref(module), name, slot
        self.weight, self.bias = module.weight, module.bias

    def __call__(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear.forward's signature: lin(input=x) works
        module = self.module_ref()
        weight, bias = module.weight, module.bias
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return F.linear(input, weight, bias)  # traced graphs: the hooks path takes the gradient; no_grad: none
        why = unfused_reason(input, weight, bias, self.weight, self.bias)
        if why is None:
            return _FusedLinear.apply(input, weight, bias, self.slot)
        out = F.linear(input, weight, bias)  # nn.Linear.forward itself
        fusion = self.slot.owner()
        if fusion is not None:
            fusion.ran_unfused(self.name, why)
        return out

    def __deepcopy__(self, memo: dict) -> object:
        # copy.deepcopy(model) while owned (an EMA copy): the copy is a plain Linear, never writing our buffers.
        # deepcopy registers the new module in memo before copying its __dict__.
        copy = memo.get(id(self.module_ref()))
        return types.MethodType(nn.Linear.forward, copy) if copy is not None else self

    def __reduce__(self) -> tuple:
        raise TypeError(
            f"GradientAccumulator (gradient_accumulation_fusion): {self.name} cannot be pickled while the accumulator "
            "owns the model; save model.state_dict(), or close() the accumulator first"
        )


class LinearFusion:
    """Installs _FusedForward on the eligible nn.Linear modules of the accumulator's model; close() removes it."""

    def __init__(
        self,
        module: nn.Module | None,
        params: Sequence[nn.Parameter],
        hooks: GradHooks,
        stats: AccumulatorStats,
    ) -> None:
        self.hooks, self.stats = hooks, stats
        self.fallbacks: dict[str, str] = {}  # parameter name -> why the hooks path takes its gradient (none fused)
        self.fused: set[int] = set()  # indices (into params) of parameters whose gradients the fusion writes
        refused: dict[int, tuple[str, str]] = {}  # index -> (the first refused Linear's name for it, why)
        installed: list[nn.Linear] = []
        self._finalizer = weakref.finalize(self, _restore, installed)
        linears = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear)] if module else []
        if not linears:
            warnings.warn(
                "GradientAccumulationConfig.gradient_accumulation_fusion=True, but the model has no nn.Linear "
                f"({'no model was given' if module is None else 'none found'}): nothing is fused",
                UserWarning,
                stacklevel=4,
            )
        index = {id(p): i for i, p in enumerate(params)}
        compiled = _is_compiled(module)
        me = weakref.ref(self)
        for name, linear in linears:
            slot = self._slot(me, name, linear, index, compiled, refused)
            if slot is not None:
                linear.forward = _FusedForward(linear, name, slot)
                installed.append(linear)
        self._record_fallbacks(refused)
        stats.fused_linear_params = len(self.fused)  # a weight shared by two fused Linears counts once
        stats.linear_fusion_fallbacks = dict(self.fallbacks)

    def _slot(
        self, me: weakref.ref, name: str, linear: nn.Linear, index: dict, compiled: bool, refused: dict
    ) -> _Slot | None:
        """The Linear's slot, or None (its parameters' reasons recorded in `refused`) when it cannot be fused."""
        w, b = index.get(id(linear.weight)), index.get(id(linear.bias)) if linear.bias is not None else None
        if w is None:  # a frozen (or foreign) weight: nothing to fuse; a trainable bias stays on the hooks path
            return None
        why = self._refusal(linear, w, compiled)
        if why is not None:
            for suffix, i in (("weight", w), ("bias", b)):
                if i is not None:
                    refused.setdefault(i, (f"{name}.{suffix}" if name else suffix, why))
            return None
        self.fused.update(i for i in (w, b) if i is not None)
        # bf16/fp16 params with fp32 buffers, or autocast activations over fp32 params: one fp32-output GEMM.
        device = linear.weight.device
        return _Slot(me, w, b, mixed_gemm=device.type == "cuda" and wgrad.probe(device) is None)

    def _refusal(self, linear: nn.Linear, w: int, compiled: bool) -> str | None:
        buffers = self.hooks.buffers
        if compiled:
            return "the model is torch.compile'd: the compiled graph computes the weight gradients"
        if type(linear).forward is not nn.Linear.forward or "forward" in vars(linear):
            return f"{type(linear).__name__} has its own forward (only nn.Linear's F.linear is fused)"
        if buffers.layout[w] is not linear.weight:  # the buffers hold its local shard
            return "an FSDP2 (DTensor) parameter: FSDP2's reduce-scatter produces its gradient"
        if linear.bias is not None and linear.bias.dtype != linear.weight.dtype:
            return f"bias dtype {linear.bias.dtype} differs from weight dtype {linear.weight.dtype}"
        if buffers.buf_dtypes[w] != linear.weight.dtype and linear.weight.dtype in HALF_DTYPES:
            return wgrad.probe(linear.weight.device)
        return None

    def _record_fallbacks(self, refused: dict[int, tuple[str, str]]) -> None:
        """Lists the refused parameters that no other Linear fuses; a tied one fused elsewhere is only logged."""
        for i, (name, why) in refused.items():
            if i in self.fused:  # its refused Linear's own calls reach the shared view through the hooks path
                log.info(
                    "GradientAccumulator: gradient_accumulation_fusion fuses %s through another nn.Linear; "
                    "this module's calls reach it through the hooks path: %s",
                    name,
                    why,
                )
            else:
                self.fallbacks[name] = why
                log.warning(
                    "GradientAccumulator: gradient_accumulation_fusion leaves %s to the hooks path: %s", name, why
                )

    def ran_unfused(self, name: str, why: str) -> None:
        """A call of the fused Linear `name` ran plain F.linear (linear_fusion_calls.py): counted per reason."""
        calls = self.stats.linear_fusion_unfused_calls
        if why not in calls:
            log.info("GradientAccumulator: gradient_accumulation_fusion ran a call of %s unfused: %s", name, why)
        calls[why] = calls.get(why, 0) + 1

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Removes the fused forwards: every Linear is exactly as before (idempotent)."""
        self._finalizer()


def _is_compiled(module: nn.Module | None) -> bool:
    # torch.compile(model) returns an OptimizedModule; a model was never compiled if dynamo is not imported.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def _restore(installed: list[nn.Linear]) -> None:
    for linear in installed:
        if isinstance(vars(linear).get("forward"), _FusedForward):
            del linear.forward
