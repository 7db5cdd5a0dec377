"""What FusedAdamW, FusedSGD and FusedLion share: the GradScaler protocol, the optional global-norm clip,
bucketing a group's params into op calls (one per device, master mode and state storage), the state in its
storage (state_storage.py: fp32, bf16 or int8 codes with scales), and checkpoints that stay torch's format
for fp32 states (state_load.py checks a checkpoint before anything is written).

A step is at most two passes over the grads: the norm (only with max_grad_norm) and the fused
op. The loss-scale inverse and the clip coefficient become one device scalar, `grad_mult`,
which the op applies to every grad as it reads it; found_inf makes the op write nothing.
Nothing synchronises the host.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch

from ..ops import global_norm
from ..ops.constants import DEFAULT_EPS as CLIP_EPS
from ..ops.constants import HALF_DTYPES
from ..ops.norms import combine_norms
from ..ops.optim_args import MODES, OptimStep, check_betas
from .shards import is_sharded, on_local_shards
from .state_load import adopt_state, check_loadable
from .state_reshard import adapt_to_layout, add_fallback_companions
from .state_storage import (
    CONVERT_HINT,
    DEFAULT_INT8_MIN_NUMEL,
    DEFAULT_STATE_DTYPE,
    SCALES,
    check_group_storage,
    new_state,
    storage_of,
    stored_dtype,
    with_fallbacks,
)
from .state_tag import add_storage_tags, read_storage_tags

PARAM_MODES = tuple(MODES)
DEFAULT_PARAM_MODE = "master"


def check_betas_and_decay(betas: tuple[float, float], weight_decay: float) -> None:
    """torch.optim's checks of betas (the ops' own rule, optim_args.check_betas) and weight_decay (FusedAdamW,
    FusedLion)."""
    check_betas(betas)
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def _norm_of(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of grads on one device: the fused global_norm, torch's for float64."""
    if any(g.dtype == torch.float64 for g in grads):
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads]))
    return global_norm(grads, 2.0)


class FusedOptimizer(torch.optim.Optimizer):
    """Base of the fused optimizers. A subclass names its op (`_op`, `_record`), its state keys in the op's slot
    order (`_state_keys`), which of them a group uses (`_used_keys`) and the group's op options (`_options`)."""

    _step_supports_amp_scaling = True  # torch.amp.GradScaler hands us grad_scale and found_inf
    _state_keys: tuple[str, ...] = ()  # per-param state, in the op's slot order (its record's STATE)
    _record: ClassVar[type[OptimStep]]  # the op's record: its state lists' names and code books (SIGNED)
    _op: ClassVar[Callable[..., None]]  # the op (gradacc_ext.ops.adamw_step_, ...)

    def __init__(
        self,
        params: Any,
        defaults: dict[str, Any],
        *,
        max_grad_norm: float | None,
        param_mode: str,
        seed: int,
        backend: str,
        state_dtype: str = DEFAULT_STATE_DTYPE,
        int8_min_numel: int = DEFAULT_INT8_MIN_NUMEL,
    ) -> None:
        if defaults.get("differentiable"):
            raise ValueError(f"{type(self).__name__} does not support differentiable=True")
        if not isinstance(defaults["lr"], torch.Tensor) and not (math.isfinite(defaults["lr"]) and defaults["lr"] >= 0):
            raise ValueError(f"Invalid learning rate: {defaults['lr']}")
        if max_grad_norm is not None and not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be finite and > 0, got {max_grad_norm}")
        if param_mode not in PARAM_MODES:
            raise ValueError(f"param_mode must be one of {PARAM_MODES}, got {param_mode!r}")
        # Group keys, saved in the state_dict: the storage a checkpoint's states are in, and the seed of the
        # stochastic roundings (params' and bf16 states'), whose draws follow (seed, step count): resume is exact.
        defaults = {**defaults, "state_dtype": state_dtype, "int8_min_numel": int8_min_numel, "seed": int(seed)}
        self.check_group(defaults)
        super().__init__(params, defaults)
        for hook in (add_fallback_companions, add_storage_tags):  # FSDP2 layouts; state_dtype tags for DCP
            self.register_state_dict_post_hook(hook)  # in this order: the tags replace the names the first reads
        self.max_grad_norm = max_grad_norm
        self.param_mode = param_mode
        self.seed = int(seed)  # the default of every group's "seed"
        self.backend = backend
        self.last_grad_norm: torch.Tensor | None = None  # the pre-clip norm of the last step (max_grad_norm)

    def check_group(self, group: dict[str, Any]) -> None:
        """ValueError unless the group's state_dtype / int8_min_numel are valid (and, int8, no amsgrad)."""
        check_group_storage(type(self).__name__, group)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.check_group({**self.defaults, **param_group})
        super().add_param_group(param_group)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # a torch checkpoint may lack some of our group keys
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def state_storages(self) -> list[dict[str, int]]:
        """Per param group: the number of params whose state is in each storage ("fp32", "bf16", "int8")."""
        counts = []
        for group in self.param_groups:
            count: dict[str, int] = {}
            for p in group["params"]:
                storage = storage_of(p, group)
                count[storage] = count.get(storage, 0) + 1
            counts.append(count)
        return counts

    def __repr__(self) -> str:
        return with_fallbacks(super().__repr__(), self)

    # ---- checkpoints ----------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader casts state to the param's dtype; ours is float32 for 16-bit params (bf16 or uint8 codes
        with float32 scales in the low-bit storages, the step count a float32 tensor beside its param), so the
        saved tensors are re-read exactly. A state that does not fit its param and storage is refused before
        anything is written (state_load.check_loadable)."""
        state_dict = adapt_to_layout(self, read_storage_tags(self, state_dict))  # state_tag.py, state_reshard.py
        check_loadable(self, state_dict)
        super().load_state_dict(state_dict)
        saved_ids = (pid for group in state_dict["param_groups"] for pid in group["params"])
        placed = ((p, group) for group in self.param_groups for p in group["params"])
        by_id = dict(zip(saved_ids, placed, strict=False))
        for pid, saved in state_dict["state"].items():
            if pid in by_id:
                param, group = by_id[pid]
                adopt_state(self.state[param], param, storage_of(param, group), self._state_keys, saved)

    # ---- the step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        grad_scale: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> Any:
        """One step of every group. grad_scale: the grads are scaled by it (the step divides it
        out); found_inf: nonzero skips the step entirely. Both default to the attributes that
        torch.amp.GradScaler sets on fused optimizers."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = grad_scale if grad_scale is not None else getattr(self, "grad_scale", None)
        found_inf = found_inf if found_inf is not None else getattr(self, "found_inf", None)
        work = [(group, [p for p in group["params"] if p.grad is not None]) for group in self.param_groups]
        for _, params in work:
            for p in params:
                if p.grad.layout != torch.strided:
                    raise ValueError(f"{type(self).__name__} does not support sparse gradients ({p.grad.layout})")
        if not any(params for _, params in work):
            return loss
        device = next(params[0].device for _, params in work if params)
        grad_mult = None if grad_scale is None else torch.reciprocal(grad_scale.to(device, torch.float32))
        grad_mult = self._clip(work, grad_mult, device)
        found_inf = None if found_inf is None else found_inf.to(device, torch.float32).reshape(())
        self._run([(group, {p: p.grad for p in params}) for group, params in work], grad_mult, found_inf)
        return loss

    @torch.no_grad()
    def step_grads(
        self, grads: dict[torch.Tensor, torch.Tensor], grad_mult: torch.Tensor | None, found_inf: torch.Tensor | None
    ) -> None:
        """One step whose grads are given, not read from .grad (GradientAccumulator's fused tail: its
        float32 buffers, possibly for 16-bit params): params absent from `grads` are not stepped,
        `grad_mult` is the whole multiplier (max_grad_norm is not applied: the caller clips)."""
        work = [(group, {p: grads[p] for p in group["params"] if p in grads}) for group in self.param_groups]
        self._run(work, grad_mult, found_inf)

    def _run(self, work: list[tuple[dict, dict]], grad_mult, found_inf) -> None:
        """The op calls of every (group, {param: grad}): all prepared (states checked, made where new) before
        the first runs, so a state in the wrong storage is refused before anything is written."""
        calls = [
            self._bucket_call(group, bucket, [grads[p] for p in bucket], grad_mult, found_inf)
            for group, grads in work
            for bucket in self._buckets(group, list(grads))
        ]
        for call in calls:
            call()

    def _clip(self, work, grad_mult: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        """Folds min(1, max_norm / (norm + eps)) of the (unscaled) grads into grad_mult."""
        if self.max_grad_norm is None:
            return grad_mult
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for _, params in work:
            if any(is_sharded(p.grad) for p in params):
                raise ValueError(
                    f"{type(self).__name__}(max_grad_norm=...) cannot clip sharded (FSDP2 DTensor) gradients: its "
                    "norm would be this rank's shards' only; clip with GradientAccumulationConfig.max_grad_norm"
                )
            for p in params:
                by_device.setdefault(p.grad.device, []).append(p.grad)
        norms = [_norm_of(grads).to(device, torch.float32) for grads in by_device.values()]
        norm = combine_norms(norms, 2.0)
        if grad_mult is not None:
            norm = norm * grad_mult
        self.last_grad_norm = norm
        coef = torch.clamp(self.max_grad_norm / (norm + CLIP_EPS), max=1.0)
        return coef if grad_mult is None else grad_mult * coef

    def _buckets(self, group: dict[str, Any], params: list[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
        """One op call per device and state storage, with 16-bit params apart in master mode (only they have
        masters): a group with int8 states makes at most two calls per device, fp32 (small tensors) and int8."""
        buckets: dict[tuple[torch.device, bool, str], list[torch.Tensor]] = {}
        for p in params:
            low = self.param_mode == "master" and p.dtype in HALF_DTYPES
            buckets.setdefault((p.device, low, storage_of(p, group)), []).append(p)
        return buckets.values()

    def _bucket_call(self, group, params, grads, grad_mult, found_inf) -> Callable[[], None]:
        masters, steps = [], []
        master_mode = self.param_mode == "master" and params[0].dtype in HALF_DTYPES
        for p in params:
            state = self.state[p]
            if "step" not in state:
                self._init_state(p, state)
            if master_mode and "master_param" not in state:
                state["master_param"] = p.detach().float()
            steps.append(state["step"])
            if master_mode:
                masters.append(state["master_param"])
        states = self._state_lists(group, params, storage_of(params[0], group))
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            lr = lr.to(params[0].device, torch.float32)
        return functools.partial(
            on_local_shards(type(self)._op),
            params,
            grads,
            steps=steps,
            master_params=masters,
            **states,
            **self._options(group),
            lr=lr,
            grad_mult=grad_mult,
            found_inf=found_inf,
            maximize=bool(group["maximize"]),
            mode="master" if master_mode else ("stochastic" if self.param_mode == "stochastic" else "nearest"),
            seed=int(group["seed"]),
            backend=self.backend,
        )

    def _state_lists(self, group: dict[str, Any], params: list[torch.Tensor], storage: str) -> dict[str, list]:
        """The op's state lists (and, int8, their scales lists) for one bucket, states created as first used."""
        lists: dict[str, list] = {}
        used = self._used_keys(group)
        for slot, (key, (arg, _)) in enumerate(zip(self._state_keys, self._record.STATE, strict=True)):
            if key not in used:
                continue
            for p in params:
                state = self.state[p]
                if state.get(key) is None:
                    state.update(new_state(p, storage, key, self._record.SIGNED[slot]))
                elif state[key].dtype != stored_dtype(p, storage):
                    raise ValueError(
                        f"{type(self).__name__}: a param's {key} is {state[key].dtype}, but its group stores "
                        f"{storage!r} states (state_dtype={group['state_dtype']!r}, int8_min_numel="
                        f"{group['int8_min_numel']}); {CONVERT_HINT}"
                    )
            lists[arg] = [self.state[p][key] for p in params]
            if storage == "int8":
                lists[arg + SCALES] = [self.state[p][key + SCALES] for p in params]
        return lists

    def _init_state(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        """The step count of a param's first step (its state tensors are made as the op first needs them)."""
        state["step"] = new_step(param)

    def _used_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The state keys this group's options use (AdamW's max_exp_avg_sq only with amsgrad, ...)."""
        return self._state_keys

    def _options(self, group: dict[str, Any]) -> dict[str, Any]:
        """The op's optimizer options (betas, eps, momentum, ...) from the group."""
        raise NotImplementedError


def new_step(param: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=param.device)
