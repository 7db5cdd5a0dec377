"""GradientAccumulator: exact gradient accumulation over micro-batches, one optimizer step per window.

    acc = GradientAccumulator(model, optimizer, GradientAccumulationConfig(accumulation_steps=4), scheduler)
    for batch in loader:
        with acc.micro_step():                 # DDP no_sync and autocast, when configured
            loss = loss_fn(model(batch.x), batch.y)
            stepped = acc.backward(loss)       # True when this micro-batch closed a window
    acc.flush()                                # applies the short last window, weighted by its real size

The accumulator runs micro-steps and owns its collaborators, each in its own module: GradBuffers (the
window's gradient SUM) with WindowSums (which views hold it; each backward a transaction), GradHooks
(folds gradients into it in buckets while backward runs), Window (normaliser, weights, micro-step
count), Backprop (one backward into the window), WindowEnd (the window's end, as one sequence) with
OptimizerStepper (step, deferred scheduler step) and Checkpoint. attach() builds them (attachment.py: the
two construction phases); its reads are reads.py's, the guides' call shapes guide_calls.py's, the order
its calls must come in (and the lost window's refusal) call_order.py's, iterate()'s look-ahead look_ahead.py's.
It owns hooks on its parameters: use it as a context manager or call close() (garbage collection
removes them too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..distributed.failures import told_to_peers
from ..distributed.grad_sync import grad_sync_for
from .attachment import SetByAttach, check_attach, sort_construction
from .backprop import Backprop
from .buffers import GradBuffers
from .call_order import CallOrder
from .checkpoint import Checkpoint
from .config import GradientAccumulationConfig
from .guide_calls import GuideCalls
from .hooks import GradHooks
from .linear_fusion import LinearFusion
from .look_ahead import LoaderLookAhead
from .loss_checks import MigrationChecks
from .loss_scale import LossScale
from .params import check_optimizer, trainable
from .reads import AccumulatorReads
from .stats import AccumulatorStats
from .stepper import OptimizerStepper
from .window import Window, check_loss
from .window_end import WindowEnd

LossFn = Callable[[Any, Any], "torch.Tensor | tuple[torch.Tensor, int | torch.Tensor]"]


class GradientAccumulator(AccumulatorReads, GuideCalls):
    """Runs micro-batches and steps the optimizer (and scheduler) once per window.

    GradientAccumulator(model_or_params, optimizer, config, scheduler=None, scaler=None), or
    GradientAccumulator(config) now and attach(model_or_params, optimizer, scheduler=None, scaler=None)
    later (until then, what needs the model raises NotAttachedError).
    model_or_params: the model (an nn.Module, possibly DDP- or FSDP2-wrapped)
      or an iterable of parameters; frozen parameters are ignored.
    optimizer: any torch.optim.Optimizer over these parameters (one that holds
      none of them is an error, one that holds only some a warning).
    scheduler: stepped once per real optimizer step (never on skipped ones).
    scaler: a torch.amp.GradScaler for mixed_precision="fp16" (one is created
      from the config when omitted).
    The guides' call shapes (accumulate_gradients, get_accumulation_stats, ...) are in guide_calls.py.
    """

    # What attach() sets, declared (attachment.py): read before attach(), each raises NotAttachedError.
    (module, params, optimizer, scheduler, device, stats, _checks, _sync, _buffers, _loss_scale, _window, _stepper,
     _end, _checkpoint, _sums, _hooks, _fusion, _backprop) = SetByAttach.many(18)  # fmt: skip

    def __init__(
        self,
        model_or_params: torch.nn.Module | Any | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        config: GradientAccumulationConfig | None = None,
        scheduler: Any | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        model_or_params, self.config = sort_construction(model_or_params, config)
        self.attached = False
        self._order = CallOrder()
        self._data = LoaderLookAhead()  # iterate(): whether the batch it yielded is the loader's last
        if model_or_params is not None or optimizer is not None:
            self.attach(model_or_params, optimizer, scheduler, scaler)
        elif scheduler is not None or scaler is not None:
            raise TypeError("GradientAccumulator: scheduler and scaler are given with the model and optimizer")

    def attach(
        self,
        model_or_params: torch.nn.Module | Any,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        """Gives the accumulator its model and optimizer (once): builds the window and registers the hooks."""
        check_attach(self.attached, model_or_params, optimizer, scheduler)
        module, params = trainable(model_or_params)
        check_optimizer(module, params, optimizer)  # before anything is set: a refused pair leaves no trace
        c = self.config
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
        self._checkpoint = Checkpoint(
            c, self._window, self._buffers, self.stats, self._loss_scale, self._stepper, self._sync
        )
        self._sums = self._buffers.sums
        self._hooks = GradHooks(self.params, self._sums, c.bucket_size_bytes, c.grad_views)  # registers hooks
        fusion = c.gradient_accumulation_fusion  # installs fused Linear forwards (after the hooks it writes beside)
        self._fusion = LinearFusion(self.module, self.params, self._hooks, self.stats) if fusion else None
        self._backprop = Backprop(
            self.params, self.device, self._loss_scale, self._sync, self._buffers, self._hooks, self._window, self.stats
        )
        self.attached = True

    # -- owning the hooks -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Removes the hooks: the parameters get plain .grad behaviour again. Does not apply the open window."""
        if not self.attached:  # built as GradientAccumulator(config) and never attached: no hooks
            return
        if self._fusion is not None:
            self._fusion.close()
        self._hooks.close()

    def __enter__(self) -> GradientAccumulator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- running micro-batches --------------------------------------------------------------------------------------

    def iterate(self, loader: Iterable) -> Iterator[Any]:
        """Yields the loader's batches, fetching one ahead (Accelerate's end_of_dataloader): the last batch's
        micro-step closes the window as micro_step(last=True) does, so the short last window needs no flush()."""
        return self._data.iterate(loader)

    @contextlib.contextmanager
    def micro_step(self, last: bool = False) -> Iterator[GradientAccumulator]:
        """Run one micro-batch's forward and backward() inside: enters DDP's no_sync and the configured autocast.

        last=True: this micro-batch closes the window even if it is short (the
        data's last batch; iterate() sets this for the loader's last batch);
        under HSDP and FSDP2's "window" mode it saves flush() the extra
        collectives that release FSDP's held sums.
        If the body raises, the partial gradients of that micro-batch are dropped
        and the window is left as it was before it; where that cannot be exact (its
        backward had added into earlier micro-steps' sums) the window is lost and the
        next micro_step(), backward() or flush() raises until discard_window(). Data-parallel:
        an OOM that leaves it before this rank ran any collective in it (always under DDP
        ddp_reduce="buffer", until the closing micro-step's window end) may be
        caught and the micro-batch retried, or skipped, within
        GRADACC_PEER_WATCH_RETRY_S (20 s); the other ranks are not held up. Any
        other OOM gives up the step: every other rank raises PeerOutOfMemoryError
        naming this one (distributed/failures.py, peer_watch.py, docs/distributed.md).
        """
        self._order.enter_micro_step(last)
        try:
            closes = self.sync_gradients or self._order.closing
            sync = self._sync.context(closes)  # may refuse first (FSDP2, DDP overlap)
            self._order.refuse_lost_window("micro_step")
            with told_to_peers(self._sync.reduces), sync, self._autocast():  # reduces: a data-parallel strategy
                yield self
        except BaseException:
            self._backprop.drop_grads()
            raise
        finally:
            self._order.leave_micro_step()

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
        self._order.check_backward(self._sync.needs_context, self._hooks.closed)
        check_loss(loss)
        self._checks(loss, self._order.in_micro_step)
        return self._backward_into_window(loss, num_items)

    def _backward_into_window(
        self,
        loss: torch.Tensor,
        num_items: int | torch.Tensor | None,
        share: float = 1.0,
        completes: bool = True,
        may_close: bool = True,
    ) -> bool:
        """One backward of a micro-batch, or of the part `share` of it (the adaptive accumulator's splits); only
        the backward that completes a micro-batch counts as a micro-step and can close the window (unless
        may_close=False: an earlier micro-batch of the window, replayed)."""
        weight, count = self._window.weight(num_items, share)
        final = completes and may_close and (self._order.closing or self.sync_gradients)
        with told_to_peers(self._sync.reduces and not self._order.in_micro_step):  # inside one, micro_step() tells
            try:
                self._backprop.run(
                    loss, weight, count, weighted=num_items is not None, completes_micro_batch=completes, final=final
                )
            except BaseException as error:
                if self._backprop.discarded:
                    self._window_discarded(error)
                raise
            self._order.backward_done = True
            if final:
                self._end.close(self._window)
        return final

    def _window_discarded(self, error: BaseException) -> None:
        """A failed backward had added into earlier micro-steps' sums: the open window was discarded, and the
        accumulator refuses to go on until the caller drops it (call_order.py; the adaptive one replays it)."""
        self._order.window_lost = True

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
        self._order.refuse_inside_micro_step("flush", "; call it after the micro-batch")
        self._order.refuse_lost_window("flush")
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
        self._order.refuse_inside_micro_step("discard_window")
        self._buffers.release()
        self._window.reset()
        self._order.window_lost = False

    # -- checkpointing ----------------------------------------------------------------------------------------------

    def state_dict(self, replicated: bool = False) -> dict[str, Any]:
        """Mid-window buffers, counters and loss scale; save it with the model, optimizer and scheduler.

        replicated=True: one plain state that every rank can load, for frameworks that save rank 0's file alone
        (Lightning under DDP); only at a window boundary (raises mid-window, changing nothing).
        """
        self._order.refuse_inside_micro_step("state_dict")
        return self._checkpoint.state_dict(replicated)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._checkpoint.load_state_dict(state)
        self._order.window_lost = False  # the loaded window replaces the lost one
