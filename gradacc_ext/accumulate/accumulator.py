"""GradientAccumulator: exact gradient accumulation over micro-batches, one optimizer step per window.

    acc = GradientAccumulator(model, optimizer, GradientAccumulationConfig(accumulation_steps=4), scheduler)
    for batch in loader:
        with acc.micro_step():                 # DDP no_sync and autocast, when configured
            loss = loss_fn(model(batch.x), batch.y)
            stepped = acc.backward(loss)       # True when this micro-batch closed a window
    acc.flush()                                # applies the short last window, weighted by its real size

How a window is computed (see GradBuffers): each backward's fresh gradients
are added into the accumulator's own flat buffers (the first one assigned,
so no zeroing pass) and param.grad is dropped. The buffers hold a SUM; the
window's normaliser (micro-batch count, or item count across ranks) and the
fp16 loss scale are applied once, in the final micro-step's fused pass
(accumulate, unscale, inf check and global norm in one pass over memory),
as the device tensor inv_scale = 1 / (loss_scale * normaliser). Clipping
then acts on the fully accumulated, unscaled gradient, and the optimizer
sees the buffers as param.grad.

Host syncs: none per micro-step. Per window, one (reading found_inf to skip
a non-finite step) when skip_nonfinite is on and the optimizer is not fused;
none with a fused optimizer (torch's Adam/AdamW/SGD with fused=True), which
gets found_inf as a tensor and skips on the device. Then whether the window
was skipped is read lazily: the scheduler step of window k (taken only if
it was a real step) happens just before window k+1's optimizer step, or at
flush(), state_dict(), synchronize() or a stats read, whichever comes first,
so every optimizer step uses exactly the learning rate of the plain loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..distributed.grad_sync import grad_sync_for
from .buffers import GradBuffers
from .config import GradientAccumulationConfig
from .loss_scale import LossScale
from .stats import GB, AccumulatorStats, StepInfo

STATE_VERSION = 1
LossFn = Callable[[Any, Any], "torch.Tensor | tuple[torch.Tensor, int | torch.Tensor]"]


class _DeferredFlag:
    """found_inf of a fused step, copied to the host without waiting; read when needed."""

    def __init__(self, flag: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if flag.is_cuda:
            self._host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
            self._host.copy_(flag, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flag.clone()

    def get(self) -> bool:
        if self._event is not None:
            self._event.synchronize()  # waits for this copy only, long done by the next window
        return bool(self._host.item())


def _trainable(model_or_params: torch.nn.Module | Any) -> tuple[torch.nn.Module | None, list[torch.nn.Parameter]]:
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
    # Frozen parameters (requires_grad=False) are excluded; shared ones counted once.
    trainable = list({id(p): p for p in params if p.requires_grad}.values())
    if not trainable:
        raise ValueError("GradientAccumulator: no trainable parameters (all have requires_grad=False)")
    return module, trainable


class GradientAccumulator:
    """Runs micro-batches and steps the optimizer (and scheduler) once per window.

    model_or_params: the model (an nn.Module, possibly DDP- or FSDP2-wrapped)
      or an iterable of parameters; frozen parameters are ignored.
    optimizer: any torch.optim.Optimizer over these parameters.
    scheduler: stepped once per real optimizer step (never on skipped ones).
    scaler: a torch.amp.GradScaler for mixed_precision="fp16" (one is created
      from the config when omitted).
    """

    def __init__(
        self,
        model_or_params: torch.nn.Module | Any,
        optimizer: torch.optim.Optimizer,
        config: GradientAccumulationConfig,
        scheduler: Any | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if not isinstance(config, GradientAccumulationConfig):
            raise TypeError(f"GradientAccumulator: config must be a GradientAccumulationConfig, got {type(config)}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"GradientAccumulator: optimizer must be a torch.optim.Optimizer, got {type(optimizer)}")
        if scheduler is not None and not callable(getattr(scheduler, "step", None)):
            raise TypeError(f"GradientAccumulator: scheduler must have a step() method, got {type(scheduler)}")
        self.config = config
        self.module, self.params = _trainable(model_or_params)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self._sync = grad_sync_for(self.module, self.params, config)  # validates; no collective runs
        self._buffers = GradBuffers(
            self.params, config.accum_dtype, config.backend, self._sync.layout(self.params), self._sync.param_grad
        )
        self.device = self._buffers.device
        self._loss_scale = self._make_loss_scale(scaler)
        self._user_scaler = scaler
        # GradScaler's protocol: fused optimizers take found_inf (and grad_scale) as tensors.
        self._fused_step = bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and config.skip_nonfinite
        scalar = torch.float64 if torch.float64 in self._buffers.flats else torch.float32
        self._found_inf = torch.zeros((), dtype=torch.float32, device=self.device)  # 0-d, as fused steps expect
        self._norm = torch.zeros(1, dtype=scalar, device=self.device)
        self._scalar_dtype = scalar
        self.stats = AccumulatorStats(self.device, config.grad_norm_history, config.track_memory)
        self._pending: _DeferredFlag | None = None
        self._last_skipped: bool | None = None
        self._in_micro_step = False
        self._closing = False  # micro_step(last=True): this micro-batch closes the window
        self._backward_done = False
        self._last_backpropagated: torch.Tensor | None = None
        self._reset_window()

    def _make_loss_scale(self, scaler: torch.amp.GradScaler | None) -> LossScale | None:
        mode = self.config.mixed_precision
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"GradientAccumulator: scaler must be a torch.amp.GradScaler, got {type(scaler)}")
        if mode != "fp16":
            if scaler is not None:
                raise ValueError(
                    f"GradientAccumulator: a scaler was given but config.mixed_precision={mode!r}; "
                    "loss scaling is only used with mixed_precision='fp16'"
                )
            return None
        if scaler is None:
            c = self.config
            scaler = torch.amp.GradScaler(
                self.device.type,
                init_scale=c.init_scale,
                growth_factor=c.growth_factor,
                backoff_factor=c.backoff_factor,
                growth_interval=c.growth_interval,
            )
        return LossScale(scaler)

    def _reset_window(self) -> None:
        self._micro = 0  # micro-steps accumulated in the open window
        self._count_host = 0.0  # the window's normaliser, host part (ints)
        self._count_dev: torch.Tensor | None = None  # ... and device part (tensor item counts)
        self._weighted: bool | None = None  # mean mode: were num_items given in this window?

    # -- running micro-batches --------------------------------------------------------------------------------------

    @property
    def accumulation_steps(self) -> int:
        return int(self.config.accumulation_steps)

    @property
    def sync_gradients(self) -> bool:
        """True when the next backward closes the window (Accelerate's name)."""
        return self._micro + 1 == self.accumulation_steps

    @contextlib.contextmanager
    def micro_step(self, last: bool = False) -> Iterator[GradientAccumulator]:
        """Run one micro-batch's forward and backward() inside: enters DDP's no_sync and the configured autocast.

        last=True: this micro-batch closes the window even if it is short (the
        data's last batch); needed instead of flush() under HSDP and FSDP2's
        "window" mode, where only a synced backward releases FSDP's sums.
        If the body raises, the partial gradients of that micro-batch are dropped
        and the window is left as it was before it.
        """
        if self._in_micro_step:
            raise RuntimeError("GradientAccumulator.micro_step() cannot be nested")
        self._in_micro_step, self._backward_done, self._closing = True, False, bool(last)
        try:
            with self._sync.context(self.sync_gradients or self._closing), self._autocast():
                yield self
        except BaseException:
            self._drop_grads()
            raise
        finally:
            self._in_micro_step = self._closing = False

    def _autocast(self) -> contextlib.AbstractContextManager:
        mode = self.config.mixed_precision
        if mode == "no":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.float16 if mode == "fp16" else torch.bfloat16)

    def backward(self, loss: torch.Tensor, num_items: int | torch.Tensor | None = None) -> bool:
        """Backpropagate one micro-batch's loss into the window; returns True when it closed the window.

        loss: "mean" mode: the micro-batch's mean loss; "sum" mode: its SUM over items.
        num_items: items (samples/tokens) in this micro-batch, an int or a device
          tensor (never read on the host); required in "sum" mode; in "mean" mode,
          when given for every micro-batch, micro-batches are weighted by it.
        """
        if self._sync.needs_context and not self._in_micro_step:
            raise RuntimeError(
                "GradientAccumulator.backward: with a DistributedDataParallel model the forward and backward must "
                "run inside `with acc.micro_step():` (DDP decides during forward whether to all-reduce)"
            )
        if self._in_micro_step and self._backward_done:
            raise RuntimeError("GradientAccumulator.backward: called twice inside one micro_step()")
        self._check_loss(loss)
        weight, count = self._weight(num_items)
        return self._backprop(loss, weight, count, weighted=num_items is not None, completes_micro_batch=True)

    @staticmethod
    def _check_loss(loss: object) -> None:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError(
                "GradientAccumulator.backward: loss must be a one-element tensor that requires grad, got "
                + (
                    f"shape {list(loss.shape)}, requires_grad={loss.requires_grad}"
                    if isinstance(loss, torch.Tensor)
                    else type(loss).__name__
                )
            )

    def _backprop(
        self,
        loss: torch.Tensor,
        weight: float | torch.Tensor,
        count: float | torch.Tensor,
        *,
        weighted: bool,
        completes_micro_batch: bool,
    ) -> bool:
        """Backward of one micro-batch or of one part of it (the adaptive accumulator's splits).

        weight multiplies this part's gradient and count is its share of the
        window's normaliser; only the part that completes a micro-batch counts
        as a micro-step, and only it can close the window.
        """
        final = completes_micro_batch and (self._closing or self._micro + 1 == self.accumulation_steps)
        scaled = self._loss_scale.scale(loss) if self._loss_scale is not None else loss
        self._sync.before_backward(final, self._buffers)
        try:
            # Backward runs outside autocast (torch's recommendation); ops reuse the forward's dtypes.
            with torch.autocast(self.device.type, enabled=False):
                scaled.reshape(()).backward()
        except BaseException:
            self._drop_grads()
            raise
        self._commit_count(weighted, count)
        self._last_backpropagated = scaled.detach()
        self._backward_done = True
        grads = [self._sync.local_grad(p.grad) for p in self.params]
        if completes_micro_batch:
            self._micro += 1
            self.stats.micro_step()
        if final:
            self._close_window(grads, weight)
            return True
        self._buffers.add(grads, weight)
        self._drop_grads()
        return False

    def step_batch(self, batch: Any, loss_fn: LossFn) -> bool:
        """One micro-batch through a callable: loss_fn(model, batch) -> loss or (loss, num_items)."""
        with self.micro_step():
            out = loss_fn(self.module, batch)
            loss, num_items = out if isinstance(out, tuple) else (out, None)
            return self.backward(loss, num_items)

    def flush(self) -> bool:
        """Apply the open (short) window, weighted by its real size; False (a no-op) when it is empty.

        Call it at the end of an epoch or of training; calling it again is a
        no-op. Under DDP every rank must call it with the same window length.
        """
        if self._in_micro_step:
            raise RuntimeError("GradientAccumulator.flush: called inside micro_step(); call it after the micro-batch")
        self._resolve_pending()
        if self._micro == 0:
            return False
        self._close_window(None, None)
        self._resolve_pending()
        return True

    def synchronize(self) -> None:
        """Resolve a deferred fused step: count it and step the scheduler if it was real (one host read)."""
        self._resolve_pending()

    # -- normalisation ----------------------------------------------------------------------------------------------

    def _weight(self, num_items: int | torch.Tensor | None) -> tuple[float | torch.Tensor, float | torch.Tensor]:
        """(weight of this micro-step's gradient, its contribution to the window's normaliser)."""
        mode = self.config.loss_normalization
        if num_items is None:
            if mode == "sum":
                raise ValueError(
                    "GradientAccumulator.backward: num_items is required with loss_normalization='sum' "
                    "(the loss is a sum over items and the window is divided by their total)"
                )
            if self._weighted:
                raise ValueError(
                    "GradientAccumulator.backward: num_items must be given for every micro-batch of a "
                    "window or for none (it was given earlier in this window)"
                )
            return 1.0, 1.0
        if self._weighted is False:
            raise ValueError(
                "GradientAccumulator.backward: num_items must be given for every micro-batch of a "
                "window or for none (it was omitted earlier in this window)"
            )
        if not self._sync.weights_micro_batches and mode == "mean":
            raise ValueError(
                f"GradientAccumulator.backward: with {self._sync.name}, gradients are reduced across ranks before "
                "the accumulator sees them, so micro-batches cannot be weighted; use loss_normalization='sum' with "
                "num_items, or omit num_items"
            )
        if isinstance(num_items, torch.Tensor):
            if num_items.numel() != 1 or num_items.is_complex() or num_items.dtype == torch.bool:
                raise ValueError(
                    f"GradientAccumulator.backward: num_items must be an int or a one-element real tensor, "
                    f"got shape {list(num_items.shape)} dtype {num_items.dtype}"
                )
            count = num_items.detach().to(self.device).reshape(1)
            weight = count.to(torch.float32) if mode == "mean" else 1.0
            return weight, count
        if isinstance(num_items, bool) or not isinstance(num_items, int) or num_items < 0:
            raise ValueError(
                f"GradientAccumulator.backward: num_items must be an int >= 0 or a tensor, got {num_items!r}"
            )
        return (float(num_items) if mode == "mean" else 1.0), float(num_items)

    def _commit_count(self, weighted: bool, count: float | torch.Tensor) -> None:
        if self.config.loss_normalization == "mean":
            self._weighted = weighted
        if isinstance(count, torch.Tensor):
            count = count.to(torch.float64)
            self._count_dev = count if self._count_dev is None else self._count_dev + count
        else:
            self._count_host += count

    def _window_count(self) -> torch.Tensor:
        count = torch.full((1,), self._count_host, dtype=torch.float64, device=self.device)
        return count if self._count_dev is None else count + self._count_dev

    def _inv_scale(self, count: torch.Tensor) -> torch.Tensor:
        denominator = count
        if self._loss_scale is not None:
            denominator = denominator * self._loss_scale.tensor(self.device).to(torch.float64).reshape(1)
        return (1.0 / denominator).to(self._scalar_dtype)

    # -- the window end ---------------------------------------------------------------------------------------------

    def _close_window(self, grads: list[torch.Tensor | None] | None, weight: float | torch.Tensor | None) -> None:
        c, b = self.config, self._buffers
        self._sync.before_finish()
        self._found_inf.zero_()
        count = self._window_count()
        if self._sync.reduces:
            if grads is not None:
                self._sync.add_final(b, grads, weight)
            self._sync.reduce(b, count)
            b.finish(self._inv_scale(count), self._found_inf, self._norm, c.norm_type)
        elif grads is not None:
            b.add_final(grads, weight, self._inv_scale(count), self._found_inf, self._norm, c.norm_type)
        else:
            b.finish(self._inv_scale(count), self._found_inf, self._norm, c.norm_type)
        self._sync.global_norm(self._norm, self._found_inf, c.norm_type)
        b.clip(self._norm, c.max_grad_norm, c.clip_value)
        b.expose()
        scale = self._loss_scale.tensor(self.device).clone() if self._loss_scale is not None else None
        self._step()
        if self._loss_scale is not None:
            self._loss_scale.update(self._found_inf)
        b.release()
        micro = self._micro
        self._reset_window()
        self.stats.window(micro, self._norm, self._found_inf, scale, count)

    def _step(self) -> None:
        optimizer = self.optimizer
        if self._fused_step:
            self._resolve_pending()
            # The buffers are already unscaled: only found_inf, which makes the kernel skip on the device.
            optimizer.grad_scale, optimizer.found_inf = None, self._found_inf
            try:
                optimizer.step()
            finally:
                del optimizer.grad_scale, optimizer.found_inf
            self._pending = _DeferredFlag(self._found_inf)
            return
        skipped = self.config.skip_nonfinite and bool(self._found_inf.item())  # the window's one host sync
        if not skipped:
            optimizer.step()
        self._record_outcome(skipped)

    def _record_outcome(self, skipped: bool) -> None:
        self._last_skipped = skipped
        self.stats.outcome(skipped)
        if not skipped and self.scheduler is not None:
            self.scheduler.step()

    def _resolve_pending(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._record_outcome(pending.get())

    def _drop_grads(self) -> None:
        for p in self.params:
            p.grad = None

    # -- observing --------------------------------------------------------------------------------------------------

    @property
    def last_step_skipped(self) -> bool | None:
        """Whether the last closed window's step was skipped (inf/NaN); None before the first. May sync."""
        self._resolve_pending()
        return self._last_skipped

    @property
    def optimizer_steps(self) -> int:
        self._resolve_pending()
        return self.stats.optimizer_steps

    @property
    def skipped_steps(self) -> int:
        self._resolve_pending()
        return self.stats.skipped_steps

    @property
    def micro_steps_in_window(self) -> int:
        return self._micro

    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (a host read), or None without fp16."""
        if self._loss_scale is None:
            return None
        scale = self._loss_scale.tensor(self.device)
        return float(scale.item())

    def grad_norm_history(self) -> torch.Tensor:
        """Pre-clip global grad norms of the last windows (CPU float32, oldest first; one host read)."""
        return self.stats.grad_norm_history()

    def add_callback(self, callback: Callable[[StepInfo], None]):
        """Subscribe a logger: callback(StepInfo) after every window; returns a handle with remove()."""
        return self.stats.add_callback(callback)

    def reset_stats(self) -> None:
        self._resolve_pending()
        self.stats.reset()

    def accumulate_gradients(
        self,
        loss: torch.Tensor,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: torch.amp.GradScaler | None = None,
        *,
        num_items: int | torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """Compatibility entry point of the guides: backward(loss, num_items) plus a stats dict.

        model/optimizer/scaler may be passed as in the guides' call shape; each
        must be the object this accumulator was built with. Values are host
        numbers or device tensors (formatting a tensor reads it).
        """
        for name, given, mine in (
            ("model", model, self.module),
            ("optimizer", optimizer, self.optimizer),
            ("scaler", scaler, self._loss_scale.scaler if self._loss_scale is not None else None),
        ):
            if given is not None and given is not mine:
                raise ValueError(
                    f"GradientAccumulator.accumulate_gradients: the {name} passed is not the one this accumulator "
                    "was built with"
                )
        closed = self.backward(loss, num_items)
        position = self.accumulation_steps if closed else self._micro
        return {
            "should_update": closed,
            "should_step": closed,
            "accumulation_step": position,
            "accumulation_steps": self.accumulation_steps,
            "effective_batch_size": self.config.effective_batch_size,
            "original_loss": loss.detach(),
            "scaled_loss": self._last_backpropagated,
            "grad_norm": self._norm.reshape(()).clone() if closed else None,
            "loss_scale": self._loss_scale.tensor(self.device) if self._loss_scale is not None else None,
            "memory_used": torch.cuda.memory_allocated(self.device) / GB if self.device.type == "cuda" else 0.0,
            "micro_steps": self.stats.micro_steps,
            "windows": self.stats.windows,
        }

    def get_accumulation_stats(self) -> dict[str, Any]:
        """Every statistic as host values (reads the device-side norm history: one sync)."""
        self._resolve_pending()
        norms = self.stats.grad_norm_history()
        finite = norms[torch.isfinite(norms)]
        step_time = self.stats.mean_step_time()
        return {
            **self.stats.counters(),
            "current_step": self.stats.optimizer_steps,
            "accumulation_step": self._micro,
            "accumulation_steps": self.accumulation_steps,
            "effective_batch_size": self.config.effective_batch_size,
            "target_batch_size": self.config.target_batch_size,
            "loss_scale": self.loss_scale(),
            "grad_norm_history": norms.tolist(),
            "last_gradient_norm": float(norms[-1]) if len(norms) else None,
            "avg_gradient_norm": float(finite.mean()) if len(finite) else None,
            "peak_memory_gb": self.stats.peak_memory_gb(),
            "memory_usage": list(self.stats.memory_usage),
            "time_per_micro_step_s": self.stats.mean_micro_step_time(),
            "time_per_step_s": step_time,
            "avg_accumulation_time": step_time,
            "config": self.config.to_dict(),
        }

    # -- checkpointing ----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Mid-window buffers, counters and loss scale; save it with the model, optimizer and scheduler."""
        if self._in_micro_step:
            raise RuntimeError("GradientAccumulator.state_dict: called inside micro_step()")
        self._resolve_pending()
        state = {
            "version": STATE_VERSION,
            "accumulation_steps": self.accumulation_steps,
            "loss_normalization": self.config.loss_normalization,
            "micro": self._micro,
            "count_host": self._count_host,
            "count_dev": None if self._count_dev is None else self._count_dev.clone(),
            "weighted": self._weighted,
            "buffers": self._buffers.state_dict(),
            "stats": self.stats.counters(),
            "loss_scale": self._loss_scale.state_dict() if self._loss_scale is not None else None,
        }
        return self._sync.wrap_state(state, self._buffers)  # FSDP2: DTensors, for torch.distributed.checkpoint

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"GradientAccumulator.load_state_dict: unknown state version {state.get('version')!r}")
        state = self._sync.unwrap_state(state, self._buffers)
        for key in ("accumulation_steps", "loss_normalization"):
            mine = getattr(self.config, key)
            if state[key] != mine:
                raise ValueError(
                    f"GradientAccumulator.load_state_dict: the state was saved with {key}={state[key]!r}, "
                    f"this accumulator has {mine!r}"
                )
        if (state["loss_scale"] is None) != (self._loss_scale is None):
            raise ValueError(
                "GradientAccumulator.load_state_dict: the state and this accumulator disagree on fp16 loss scaling"
            )
        self._buffers.load_state_dict(state["buffers"])
        self._micro = int(state["micro"])
        self._count_host = float(state["count_host"])
        count_dev = state["count_dev"]
        self._count_dev = None if count_dev is None else count_dev.to(self.device, torch.float64)
        self._weighted = state["weighted"]
        self.stats.load_counters(state["stats"])
        if self._loss_scale is not None:
            self._loss_scale.load_state_dict(state["loss_scale"])
        self._pending, self._last_skipped = None, None
