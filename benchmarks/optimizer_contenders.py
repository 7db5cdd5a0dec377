"""The optimizers that benchmarks/state_memory.py and benchmarks/convergence.py put side by side (issue 30).

One table, CONTENDERS: a row names how to build the optimizer and, when it cannot run in this environment,
says why (`missing`). FusedAdamW's low-memory rows (`state_dtype="bf16"|"int8"`) are already here: they run
as soon as FusedAdamW accepts `state_dtype`, and until then both benchmarks list them as not available.
torchao and bitsandbytes are optional (the `bench` extra); their rows say so when they are not installed.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from gradacc_ext.optim import FusedAdamW

Build = Callable[[list[torch.nn.Parameter], float], torch.optim.Optimizer]


@dataclass(frozen=True)
class Contender:
    name: str
    build: Build  # (params, lr) -> the optimizer, with the shared betas, eps and weight decay
    missing: Callable[[], str | None]  # why it cannot run here; None when it can
    eager: bool = False  # run torch.compile'd code eagerly (torchao compiles its per-param step itself)

    def stepping(self) -> contextlib.AbstractContextManager[None]:
        """The context the training (forward, backward, step) runs in."""
        return torch.compiler.set_stance("force_eager") if self.eager else contextlib.nullcontext()


BETAS, EPS, WEIGHT_DECAY = (0.9, 0.999), 1e-8, 0.01


def _fused(param_mode: str, state_dtype: str | None = None) -> Build:
    """FusedAdamW in `param_mode` ("stochastic": bf16 params rounded stochastically, no master weights)."""
    extra = {} if state_dtype is None else {"state_dtype": state_dtype}

    def build(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
        return FusedAdamW(params, lr, BETAS, EPS, WEIGHT_DECAY, param_mode=param_mode, **extra)

    return build


def _fused_state_dtype_missing() -> str | None:
    if "state_dtype" in inspect.signature(FusedAdamW).parameters:
        return None
    return "not available in this build: FusedAdamW does not accept state_dtype (issue 30)"


def _package_missing(module: str, dist: str) -> Callable[[], str | None]:
    def missing() -> str | None:
        if importlib.util.find_spec(module) is None:
            return f"{dist} is not installed (pip install '.[bench]')"
        return None

    return missing


def _torch_adamw(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr, BETAS, EPS, WEIGHT_DECAY, foreach=True)


def _torchao_adamw8bit(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    from torchao.optim import AdamW8bit

    # Block size 256 and the 4,096-element threshold are torchao's defaults; bf16 params round stochastically.
    return AdamW8bit(params, lr, BETAS, EPS, WEIGHT_DECAY, bf16_stochastic_round=True)


def _bnb_adamw8bit(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, lr, BETAS, EPS, WEIGHT_DECAY)


def _always() -> str | None:
    return None


FP32_STATES = "FusedAdamW fp32 states"
TORCHAO_EAGER = "torchao AdamW8bit eager"
_torchao = _package_missing("torchao", "torchao")
CONTENDERS = {
    c.name: c
    for c in (
        Contender(FP32_STATES, _fused("stochastic"), _always),
        Contender("FusedAdamW bf16 states", _fused("stochastic", "bf16"), _fused_state_dtype_missing),
        Contender("FusedAdamW int8 states", _fused("stochastic", "int8"), _fused_state_dtype_missing),
        Contender("FusedAdamW master, fp32 states", _fused("master"), _always),
        Contender("torch AdamW (foreach)", _torch_adamw, _always),
        Contender(TORCHAO_EAGER, _torchao_adamw8bit, _torchao, eager=True),
        Contender("torchao AdamW8bit compiled", _torchao_adamw8bit, _torchao),
        Contender("bitsandbytes AdamW8bit", _bnb_adamw8bit, _package_missing("bitsandbytes", "bitsandbytes")),
    )
}


def versions() -> dict[str, str]:
    """torch's version and the optional peers' (or "not installed")."""
    out = {"torch": torch.__version__}
    for dist in ("torchao", "bitsandbytes"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def tensors_of(value: object) -> Iterator[torch.Tensor]:
    """The plain tensors that hold `value`'s bytes: a tensor subclass (torchao's quantized states) is unwrapped
    into its inner tensors (codes, scales, map); lists, tuples and dicts are walked."""
    if isinstance(value, torch.Tensor):
        if type(value) is torch.Tensor or isinstance(value, torch.nn.Parameter):
            yield value
            return
        names, _ = value.__tensor_flatten__()
        for name in names:
            yield from tensors_of(getattr(value, name))
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_of(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from tensors_of(v)
