"""GradientAccumulator: exact gradient accumulation over micro-batches, one optimizer step per window.

    acc = GradientAccumulator(model, optimizer, GradientAccumulationConfig(accumulation_steps=4), scheduler)
    for batch in loader:
        with acc.micro_step():                 # DDP no_sync and autocast, when configured
            loss = loss_fn(model(batch.x), batch.y)
            stepped = acc.backward(loss)       # True when this micro-batch closed a window
    acc.flush()                                # applies the short last window, weighted by its real size

The accumulator runs micro-steps; collaborators do the rest: GradBuffers (the window's gradient SUM),
GradHooks (folds gradients into it in buckets while backward runs), Window (normaliser, weights),
WindowEnd (normalise, unscale, check, clip) with OptimizerStepper (step, deferred scheduler step),
Checkpoint and StatsReport; one backward into the window, the read side and state_dict() are mixins
(backprop.py, observing.py, checkpoint.py).
It owns hooks on its parameters: use it as a context manager or call close() (garbage collection
removes them too). Two-phase construction: __init__ keeps the config, _attach() does everything that
needs the model and optimizer: GradientAccumulator(config), the guides' form, is attached later by
attach(model, optimizer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..distributed.failures import told_to_peers
from ..distributed.grad_sync import grad_sync_for
from .backprop import AccumulatorBackprop
from .buffers import GradBuffers
from .checkpoint import AccumulatorCheckpointing, Checkpoint
from .config import GradientAccumulationConfig
from .hooks import GradHooks
from .loss_checks import MigrationChecks
from .loss_scale import LossScale
from .observing import AccumulatorObserving
from .params import check_optimizer, trainable
from .reports import StatsReport
from .stats import AccumulatorStats
from .stepper import OptimizerStepper
from .window import Window, check_loss
from .window_end import WindowEnd

LossFn = Callable[[Any, Any], "torch.Tensor | tuple[torch.Tensor, int | torch.Tensor]"]
_END = object()  # iterate(): past the loader's last batch


class GradientAccumulator(AccumulatorBackprop, AccumulatorObserving, AccumulatorCheckpointing):
    """Runs micro-batches and steps the optimizer (and scheduler) once per window.

    GradientAccumulator(model, optimizer, config, scheduler=None, scaler=None),
    or GradientAccumulator(config) and attach(model, optimizer, ...) later.
    model_or_params: the model (an nn.Module, possibly DDP- or FSDP2-wrapped)
      or an iterable of parameters; frozen parameters are ignored.
    optimizer: any torch.optim.Optimizer over these parameters (one that holds
      none of them is an error, one that holds only some a warning).
    scheduler: stepped once per real optimizer step (never on skipped ones).
    scaler: a torch.amp.GradScaler for mixed_precision="fp16" (one is created
      from the config when omitted).
    """

    def __init__(
        self,
        model_or_params: torch.nn.Module | Any | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        config: GradientAccumulationConfig | None = None,
        scheduler: Any | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if isinstance(model_or_params, GradientAccumulationConfig) and config is None:
            model_or_params, config = None, model_or_params  # GradientAccumulator(config), the guides' form
        if not isinstance(config, GradientAccumulationConfig):
            raise TypeError(f"GradientAccumulator: config must be a GradientAccumulationConfig, got {type(config)}")
        self.config = config
        self.attached = False
        self._in_micro_step = False
        self._closing = False  # micro_step(last=True): this micro-batch closes the window
        self._data_ends = False  # iterate(): the batch it yielded is the loader's last
        self._backward_done = False
        self._last_backpropagated: torch.Tensor | None = None
        if model_or_params is not None or optimizer is not None:
            self.attach(model_or_params, optimizer, scheduler, scaler)
        elif scheduler is not None or scaler is not None:
            raise TypeError("GradientAccumulator: scheduler and scaler are given with the model and optimizer")

    def __getattr__(self, name: str) -> Any:
        # Only reached for a missing attribute: before attach(), that is one _attach() sets.
        if not name.startswith("__") and self.__dict__.get("attached") is False:
            raise AttributeError(
                f"GradientAccumulator.{name}: the accumulator has no model and optimizer yet; give them with "
                "attach(model, optimizer) or GradientAccumulator(model, optimizer, config)"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def attach(
        self,
        model_or_params: torch.nn.Module | Any,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        """Gives an accumulator built as GradientAccumulator(config) its model and optimizer (once)."""
        if self.attached:
            raise RuntimeError("GradientAccumulator.attach: the accumulator already has its model and optimizer")
        for name, value in (("model_or_params", model_or_params), ("optimizer", optimizer)):
            if value is None:
                raise TypeError(f"GradientAccumulator: {name} is missing (give the model and the optimizer together)")
        self._attach(model_or_params, optimizer, scheduler, scaler)
        self.attached = True

    def _attach(
        self,
        model_or_params: torch.nn.Module | Any,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None,
        scaler: torch.amp.GradScaler | None,
    ) -> None:
        """All setup that depends on the model, optimizer, scheduler and scaler (called once)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"GradientAccumulator: optimizer must be a torch.optim.Optimizer, got {type(optimizer)}")
        if scheduler is not None and not callable(getattr(scheduler, "step", None)):
            raise TypeError(f"GradientAccumulator: scheduler must have a step() method, got {type(scheduler)}")
        c = self.config
        module, params = trainable(model_or_params)
        check_optimizer(module, params, optimizer)  # before anything is set: a refused pair leaves no trace
        self.module, self.params = module, params
        self.optimizer, self.scheduler = optimizer, scheduler
        self._checks = MigrationChecks(c)
        self._sync = grad_sync_for(self.module, self.params, c)  # validates the setup; no collective runs
        # The strategy also maps sharded parameters to their local shards for the buffers (FSDP2).
        self._buffers = GradBuffers(self.params, c.accum_dtype, c.backend, release=c.release_buffers, shards=self._sync)
        self.device = self._buffers.device
        self._loss_scale = LossScale.for_config(c, scaler, self.device)
        self.stats = AccumulatorStats(self.device, c.grad_norm_history, c.track_memory)
        self._window = Window(c.loss_normalization, self.device)
        self._stepper = OptimizerStepper(optimizer, scheduler, c.skip_nonfinite, self.stats, eager=self._sync.reduces)
        self._end = WindowEnd(c, self._buffers, self._sync, self._loss_scale, self._stepper, self.stats)
        self._checkpoint = Checkpoint(c, self._window, self._buffers, self.stats, self._loss_scale, self._stepper)
        self._report = StatsReport(c, self._window, self.stats, self._loss_scale, self._end.norm, self.device)
        self._hooks = GradHooks(self.params, self._buffers, c.bucket_size_bytes, c.grad_views)  # last: registers hooks

    # -- owning the hooks -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Removes the hooks: the parameters get plain .grad behaviour again. Does not apply the open window."""
        if self.attached:  # an accumulator never attached has no hooks
            self._hooks.close()

    def __enter__(self) -> GradientAccumulator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- running micro-batches --------------------------------------------------------------------------------------

    @property
    def accumulation_steps(self) -> int:
        return int(self.config.accumulation_steps)

    @property
    def sync_gradients(self) -> bool:
        """True when the next backward closes the window (Accelerate's name)."""
        return self._data_ends or self._window.micro + 1 == self.accumulation_steps

    def iterate(self, loader: Iterable) -> Iterator[Any]:
        """Yields the loader's batches, fetching one ahead (Accelerate's end_of_dataloader): the last batch's
        micro-step closes the window as micro_step(last=True) does, so the short last window needs no flush()."""
        try:
            batches = iter(loader)  # here, not in the generator: a bad loader fails at the call that passed it
        except TypeError:
            raise TypeError(
                f"GradientAccumulator.iterate: loader must be an iterable of batches (a DataLoader, a list), "
                f"got {type(loader).__name__}"
            ) from None
        return self._look_ahead(batches)

    def _look_ahead(self, batches: Iterator[Any]) -> Iterator[Any]:
        ahead = next(batches, _END)
        try:
            while ahead is not _END:
                batch, ahead = ahead, next(batches, _END)
                self._data_ends = ahead is _END
                yield batch
        finally:
            self._data_ends = False

    @contextlib.contextmanager
    def micro_step(self, last: bool = False) -> Iterator[GradientAccumulator]:
        """Run one micro-batch's forward and backward() inside: enters DDP's no_sync and the configured autocast.

        last=True: this micro-batch closes the window even if it is short (the
        data's last batch; iterate() sets this for the loader's last batch);
        under HSDP and FSDP2's "window" mode it saves flush() the extra
        collectives that release FSDP's held sums.
        If the body raises, the partial gradients of that micro-batch are dropped
        and the window is left as it was before it. Data-parallel: an OOM here fails
        every rank with a clear error (distributed/failures.py).
        """
        if self._in_micro_step:
            raise RuntimeError("GradientAccumulator.micro_step() cannot be nested")
        self._in_micro_step, self._backward_done, self._closing = True, False, bool(last)
        try:
            sync = self._sync.context(self.sync_gradients or self._closing)
            with told_to_peers(self._sync.reduces), sync, self._autocast():  # reduces: a data-parallel strategy
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
        if self._hooks.closed:
            raise RuntimeError("GradientAccumulator.backward: the accumulator is closed")
        if self._in_micro_step and self._backward_done:
            raise RuntimeError("GradientAccumulator.backward: called twice inside one micro_step()")
        check_loss(loss)
        self._checks(loss, self._in_micro_step)
        weight, count = self._window.weight(num_items)
        with told_to_peers(self._sync.reduces and not self._in_micro_step):  # inside one, micro_step() tells
            return self._backprop(loss, weight, count, weighted=num_items is not None, completes_micro_batch=True)

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
        self._stepper.resolve()
        if self._window.micro == 0:
            return False
        with told_to_peers(self._sync.reduces):  # the window end's collectives
            self._sync.release_held(self._hooks)  # FSDP2 "window" mode, HSDP: FSDP's held sums (fsdp.py)
            self._end.close(self._window)
        self._stepper.resolve()
        return True

    def synchronize(self) -> None:
        """Resolve a deferred fused step: count it and step the scheduler if it was real (one host read)."""
        self._stepper.resolve()

    def discard_window(self) -> None:
        """Drops the open window's gradients without an optimizer step (after an error mid-window)."""
        if self._in_micro_step:
            raise RuntimeError("GradientAccumulator.discard_window: called inside micro_step()")
        self._buffers.release()
        self._window.reset()
