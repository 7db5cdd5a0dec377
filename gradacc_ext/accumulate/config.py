"""GradientAccumulationConfig: every knob of the accumulator, checked on construction.

The window is given either directly (`accumulation_steps`) or derived from a
target effective batch: accumulation_steps = target_batch_size /
(micro_batch_size * world_size), which must divide exactly (use
gradacc_ext.planning.plan_accumulation to round a target that does not).
The accumulation guides' spellings are read by from_guide() (guide_spellings.py: GuideConfig).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch

from ..distributed.peer_watch import MODES as PEER_WATCH
from .guide_spellings import GuideConfig, GuideFields
from .precision import MIXED_PRECISION, MIXED_PRECISION_SPELLINGS, MixedPrecision

LossNormalization = Literal["mean", "sum", "none"]

LOSS_NORMALIZATION = ("mean", "sum", "none")
BACKENDS = ("auto", "ext", "torch")
ACCUM_DTYPES = (torch.float32, None)
SHARDING = ("auto", "fsdp", "hsdp")
FSDP_REDUCE = ("micro_step", "window")
DDP_REDUCE = ("buffer", "overlap")
COMM_DTYPES = (None, torch.bfloat16)


def _positive_int(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GradientAccumulationConfig.{name} must be an integer >= 1, got {value!r}")


def _positive_float(name: str, value: object, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"GradientAccumulationConfig.{name} must be a finite number > 0 or None, got {value!r}")


def _choice(name: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"GradientAccumulationConfig.{name} must be one of {choices}, got {value!r}")


@dataclass
class GradientAccumulationConfig(GuideConfig):
    """What the accumulator does; invalid values raise ValueError naming the field.

    GradientAccumulationConfig(**fields) takes the fields below; GradientAccumulationConfig.from_guide(**kw)
    also takes the accumulation guides' spellings (its base class GuideConfig, guide_spellings.py).

    Window
      accumulation_steps: micro-batches per optimizer step (>= 1). Or leave it
        None and give target_batch_size and micro_batch_size (and world_size):
        the steps are target / (micro * world), which must be an integer.
    Clipping (on the fully accumulated, unscaled gradient, once per window)
      max_grad_norm: clip the global norm to this (None or 0.0: no norm clipping,
        0.0 being nanoGPT's and HF Trainer's spelling of "off");
      norm_type: 2.0 or inf, for clipping and for the recorded grad norm;
      clip_value: clamp every gradient element to [-clip_value, clip_value]
        (applied after norm clipping when both are set).
    Precision
      mixed_precision: "no", "bf16" (autocast, no loss scaling) or "fp16"
        (autocast plus dynamic loss scaling through a torch.amp.GradScaler);
        torch.float32/bfloat16/float16 and "float32"/"bfloat16"/"float16"
        are read as "no"/"bf16"/"fp16";
      accum_dtype: torch.float32 (default) accumulates fp16/bf16 parameters'
        gradients in fp32 buffers; None accumulates in each parameter's dtype;
      init_scale, growth_factor, backoff_factor, growth_interval: the loss
        scaler the accumulator creates for fp16 when the caller gives none.
    Loss normalisation (the window's gradient is an exact mean)
      "mean": each micro-batch loss is a mean over its items; the window mean
        weights micro-batches equally, or by the `num_items` passed to
        backward() when given (then the result is the mean over all items);
      "sum": each micro-batch loss is a SUM over its items (tokens) and
        backward() must get `num_items`; the window gradient is divided by
        the total item count of the window across all ranks (the
        full-batch token mean, even with padding and variable lengths);
      "none": the loss is already divided by the caller (a loop that keeps
        `loss = loss / accumulation_steps`): the window's gradient is the
        plain sum of the micro-batch gradients, nothing more is divided.
    Steps
      skip_nonfinite: skip the optimizer (and scheduler) step when the
        accumulated gradient holds inf/NaN or its norm is not finite (an fp32 L2
        norm overflows from 2**64; docs/optimizers.md, "A norm past the float
        range"). Always on for fp16. Costs one host sync per window unless the
        optimizer is fused (then none).
      fused_step: "auto" (default) ends each window with one fused optimizer pass
        when the optimizer allows it (gradacc_ext.optim.fused_step_for: gradacc's
        fused optimizers, or torch's AdamW / Adam / SGD with options the ops
        support), else separate passes and optimizer.step(), saying why once;
        True requires the fused pass (ValueError when the optimizer cannot take
        it); False never uses it. See accumulate/window_end.py.
    Stats
      grad_norm_history: how many per-step grad norms to keep on the device (0: none);
      track_memory: record CUDA peak memory per step (host counters, no sync).
    Memory (see docs/memory.md)
      bucket_size_bytes: gradients are folded into the buffers during backward
        whenever this many bytes of them are queued. Default 1: every gradient
        is folded the moment autograd produces it, so nothing is held beside
        the buffers but that gradient, as in the plain loop (which holds it
        while autograd adds it into .grad): a window never holds more
        gradient memory than the loop it replaces. Larger values (e.g. 25 MiB,
        DDP's bucket_cap_mb) batch the folds into fewer launches and hold up
        to one bucket more;
      release_buffers: free the buffers after every optimizer step, for
        activations (re-created, without a zeroing pass, by the next window);
      grad_views: between micro-steps of a window, make param.grad a view of
        its buffer where the dtypes match, so autograd accumulates in place
        (DDP's gradient_as_bucket_view); off by default, see docs/benchmarks/memory.md;
      gradient_accumulation_fusion: every trainable nn.Linear computes its
        weight gradient straight into its buffer view (Megatron-LM's name):
        no transient dW, no extra pass; not with grad_views or
        ddp_reduce='overlap' (docs/linear-fusion.md).
    backend: "auto" (compiled kernels when available), "ext" or "torch" (reference).
    Data parallel (gradacc_ext.distributed; docs/distributed.md)
      sharding: "auto" (from the model's mesh), "fsdp" (1-D mesh) or "hsdp"
        (2-D replicate x shard mesh): the FSDP2 layout the model must have;
      fsdp_reduce: "micro_step" (default: reduce-scatter every micro-step,
        gradient memory 1/world, mid-window checkpoints) or "window" (one
        reduce-scatter per window, unsharded gradients held all window);
      ddp_reduce: "buffer" (default: one all-reduce of the flat buffers after
        the last backward) or "overlap" (DDP's bucketed reducer all-reduces
        the window's sum during the closing backward);
      comm_dtype: None (the buffers' dtype) or torch.bfloat16: DDP sends
        gradients in bf16 while accumulating in the buffers' dtype;
      peer_watch: when a peer ran out of memory, gave up the step and stays alive while this rank is
        parked in a collective: "end" (default: NCCL aborts the groups, so the call raises; gloo, which
        cannot, ends the process with exit code 75 after logging why), "log" (only log it and wait for the
        group's timeout) or "off" (no watch thread; GRADACC_PEER_WATCH=0 also turns it off).
    """

    accumulation_steps: int | None = None
    target_batch_size: int | None = None
    micro_batch_size: int | None = None
    world_size: int = 1
    max_grad_norm: float | None = None
    norm_type: float = 2.0
    clip_value: float | None = None
    mixed_precision: MixedPrecision = "no"
    accum_dtype: torch.dtype | None = torch.float32
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    loss_normalization: LossNormalization = "mean"
    skip_nonfinite: bool = True
    fused_step: bool | str = "auto"
    grad_norm_history: int = 1000
    track_memory: bool = True
    bucket_size_bytes: int = 1  # fold each gradient as it arrives: no queue beside the buffers
    release_buffers: bool = False
    grad_views: bool = False
    gradient_accumulation_fusion: bool = False
    backend: str = "auto"
    sharding: str = "auto"
    fsdp_reduce: str = "micro_step"
    ddp_reduce: str = "buffer"
    comm_dtype: torch.dtype | None = None
    peer_watch: str = "end"
    guide: GuideFields | None = field(default=None, init=False, repr=False, compare=False)  # set by from_guide()

    def __post_init__(self) -> None:
        _positive_int("world_size", self.world_size)
        _positive_int("target_batch_size", self.target_batch_size, allow_none=True)
        _positive_int("micro_batch_size", self.micro_batch_size, allow_none=True)
        self._derive_steps()
        if self.max_grad_norm == 0 and not isinstance(self.max_grad_norm, bool):
            self.max_grad_norm = None
        _positive_float("max_grad_norm", self.max_grad_norm)  # 0.0 was turned into None (off) above
        _positive_float("clip_value", self.clip_value)
        if isinstance(self.norm_type, bool) or self.norm_type not in (2, 2.0, math.inf):
            raise ValueError(f"GradientAccumulationConfig.norm_type must be 2.0 or math.inf, got {self.norm_type!r}")
        self.norm_type = float(self.norm_type)
        if isinstance(self.mixed_precision, (str, torch.dtype)):
            self.mixed_precision = MIXED_PRECISION_SPELLINGS.get(self.mixed_precision, self.mixed_precision)
        _choice("mixed_precision", self.mixed_precision, MIXED_PRECISION + tuple(MIXED_PRECISION_SPELLINGS))
        if self.accum_dtype not in ACCUM_DTYPES:
            raise ValueError(
                f"GradientAccumulationConfig.accum_dtype must be torch.float32 or None (the parameter's dtype), "
                f"got {self.accum_dtype!r}"
            )
        _positive_float("init_scale", self.init_scale, allow_none=False)
        if not (isinstance(self.growth_factor, (int, float)) and self.growth_factor > 1):
            raise ValueError(f"GradientAccumulationConfig.growth_factor must be > 1, got {self.growth_factor!r}")
        if not (isinstance(self.backoff_factor, (int, float)) and 0 < self.backoff_factor < 1):
            raise ValueError(
                f"GradientAccumulationConfig.backoff_factor must be in (0, 1), got {self.backoff_factor!r}"
            )
        _positive_int("growth_interval", self.growth_interval)
        _choice("loss_normalization", self.loss_normalization, LOSS_NORMALIZATION)
        if not isinstance(self.skip_nonfinite, bool):
            raise ValueError(f"GradientAccumulationConfig.skip_nonfinite must be a bool, got {self.skip_nonfinite!r}")
        if self.mixed_precision == "fp16" and not self.skip_nonfinite:
            raise ValueError(
                "GradientAccumulationConfig.skip_nonfinite must be True with mixed_precision='fp16': "
                "dynamic loss scaling skips every step whose gradient overflowed"
            )
        if self.fused_step not in (True, False, "auto") or not isinstance(self.fused_step, (bool, str)):
            raise ValueError(
                f"GradientAccumulationConfig.fused_step must be 'auto', True or False, got {self.fused_step!r}"
            )
        history = self.grad_norm_history
        if isinstance(history, bool) or not isinstance(history, int) or history < 0:
            raise ValueError(
                f"GradientAccumulationConfig.grad_norm_history must be an integer >= 0, got {self.grad_norm_history!r}"
            )
        _positive_int("bucket_size_bytes", self.bucket_size_bytes)
        if not isinstance(self.release_buffers, bool):
            raise ValueError(f"GradientAccumulationConfig.release_buffers must be a bool, got {self.release_buffers!r}")
        if not isinstance(self.grad_views, bool):
            raise ValueError(f"GradientAccumulationConfig.grad_views must be a bool, got {self.grad_views!r}")
        self._check_fusion()
        _choice("backend", self.backend, BACKENDS)
        _choice("sharding", self.sharding, SHARDING)
        _choice("fsdp_reduce", self.fsdp_reduce, FSDP_REDUCE)
        _choice("ddp_reduce", self.ddp_reduce, DDP_REDUCE)
        _choice("comm_dtype", self.comm_dtype, COMM_DTYPES)
        _choice("peer_watch", self.peer_watch, PEER_WATCH)

    def _check_fusion(self) -> None:
        if not isinstance(self.gradient_accumulation_fusion, bool):
            raise ValueError(
                "GradientAccumulationConfig.gradient_accumulation_fusion must be a bool, "
                f"got {self.gradient_accumulation_fusion!r}"
            )
        # Both hand param.grad to autograd, which the fused Linears never give a weight gradient.
        conflicts = {"grad_views=True": self.grad_views, "ddp_reduce='overlap'": self.ddp_reduce == "overlap"}
        for name, conflict in conflicts.items():
            if self.gradient_accumulation_fusion and conflict:
                raise ValueError(
                    f"GradientAccumulationConfig.gradient_accumulation_fusion=True cannot be combined with {name}: "
                    "the fused Linears write their gradients into the buffers, never into param.grad"
                )

    def _derive_steps(self) -> None:
        sizes_given = self.target_batch_size is not None or self.micro_batch_size is not None
        if self.accumulation_steps is None:
            if self.target_batch_size is None or self.micro_batch_size is None:
                raise ValueError(
                    "GradientAccumulationConfig needs accumulation_steps (an integer >= 1), or both "
                    "target_batch_size and micro_batch_size to derive it from"
                )
            per_step = self.micro_batch_size * self.world_size
            if self.target_batch_size % per_step:
                low = max(1, self.target_batch_size // per_step)
                raise ValueError(
                    f"GradientAccumulationConfig.target_batch_size={self.target_batch_size} is not a multiple of "
                    f"micro_batch_size * world_size = {per_step}; the nearest achievable effective batches are "
                    f"{low * per_step} ({low} steps) and {(low + 1) * per_step} ({low + 1} steps); "
                    "gradacc_ext.planning.plan_accumulation chooses one for you"
                )
            self.accumulation_steps = self.target_batch_size // per_step
            return
        _positive_int("accumulation_steps", self.accumulation_steps)
        if sizes_given and self.target_batch_size is not None and self.micro_batch_size is not None:
            implied = self.micro_batch_size * self.world_size * self.accumulation_steps
            if implied != self.target_batch_size:
                raise ValueError(
                    f"GradientAccumulationConfig: accumulation_steps={self.accumulation_steps} with "
                    f"micro_batch_size={self.micro_batch_size} and world_size={self.world_size} gives an effective "
                    f"batch of {implied}, not target_batch_size={self.target_batch_size}; give one or make them agree"
                )

    @property
    def effective_batch_size(self) -> int | None:
        """Items per optimizer step across all ranks, when the micro-batch size is known."""
        if self.micro_batch_size is None:
            return self.target_batch_size
        return self.micro_batch_size * self.world_size * self.accumulation_steps

    def to_dict(self) -> dict[str, Any]:
        """A plain dict for logs and the stats API (the dtype as its name); from_guide()'s config also echoes
        every field the guide passed, under the guide's name (GuideFields.echo)."""
        core = [f.name for f in fields(self) if f.init]
        out = {name: getattr(self, name) for name in core}
        for key in ("accum_dtype", "comm_dtype"):
            out[key] = None if out[key] is None else str(out[key]).replace("torch.", "")
        out["effective_batch_size"] = self.effective_batch_size
        return out if self.guide is None else self.guide.echo(out, core)
