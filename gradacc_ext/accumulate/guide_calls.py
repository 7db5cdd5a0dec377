"""The accumulation guides' call shapes, as methods of GradientAccumulator (its base class GuideCalls).

accumulate_gradients in either guide's argument order (backward() plus a stats dict; the first call
attaches an accumulator built as GradientAccumulator(config), as the guides do), get_accumulation_stats,
current_step, accumulation_context and update_config: each a thin wrapper of the accumulator's own
methods. Their stats dicts are guide_reports.py's; the guides' config spellings guide_spellings.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .guide_devices import device_report
from .guide_reports import after_backward, all_stats, check_same_objects
from .guide_spellings import ALIASES

# What update_config(**fields) may change between windows; the rest shapes the buffers or the loss scale.
UPDATABLE = ("accumulation_steps", "max_grad_norm", "gradient_clipping", "gradient_clip_norm", "clip_value",
             "gradient_clip_value", "norm_type", "skip_nonfinite")  # fmt: skip


def _guide_call(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of accumulate_gradients by name, from either guide's order.

    seed 000: (loss, model, optimizer, scaler=None); seed 001: (model, loss, batch_size, optimizer, scaler=None).
    The first argument tells them apart: a loss tensor or a model.
    """
    first = args[0] if args else kwargs.get("loss", kwargs.get("model"))
    if isinstance(first, torch.nn.Module) and args:
        names = ("model", "loss", "batch_size", "optimizer", "scaler")
    else:
        names = ("loss", "model", "optimizer", "scaler")
    if len(args) > len(names):
        raise TypeError(f"accumulate_gradients: at most {len(names)} positional arguments {names}, got {len(args)}")
    call = dict(zip(names, args, strict=False))
    for name, value in kwargs.items():
        if name in call:
            raise TypeError(f"accumulate_gradients: {name} given by position and by keyword")
        call[name] = value
    unknown = set(call) - {"loss", "model", "batch_size", "optimizer", "scaler", "num_items"}
    if unknown:
        raise TypeError(f"accumulate_gradients: unexpected arguments {sorted(unknown)}")
    if "loss" not in call:
        raise TypeError("accumulate_gradients: the loss is missing")
    if "batch_size" in call:  # seed 001 passes data.size(0): the micro-batch's item count
        if call.get("num_items") is not None:
            raise TypeError("accumulate_gradients: give batch_size or num_items, not both")
        call["num_items"] = call.pop("batch_size")
    return call


class GuideCalls:
    """The guides' entry points on GradientAccumulator; each calls the accumulator's own methods."""

    def accumulate_gradients(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """backward(loss, num_items) plus a stats dict (guide_reports.after_backward), in either guide's order.

        accumulate_gradients(loss, model=None, optimizer=None, scaler=None, *, num_items=None) (seed 000) or
        accumulate_gradients(model, loss, batch_size, optimizer=None, scaler=None) (seed 001: batch_size weighs
        the micro-batch by its size, as num_items does). The model, optimizer and scaler passed must be the
        accumulator's own (a disabled scaler means no loss scaling); an accumulator built as
        GradientAccumulator(config) is attached to them by its first call.
        """
        call = _guide_call(args, kwargs)
        model, optimizer, scaler = call.get("model"), call.get("optimizer"), call.get("scaler")
        if not self.attached:
            self.attach(model, optimizer, scaler=scaler)
        own_scaler = self.window_state().scaler
        if scaler is not None and own_scaler is None and not scaler.is_enabled():
            scaler = None
        check_same_objects(
            model=(model, self.module), optimizer=(optimizer, self.optimizer), scaler=(scaler, own_scaler)
        )
        closed = self.backward(call["loss"], call.get("num_items"))
        return after_backward(self, closed, call["loss"])

    @property
    def current_step(self) -> int:
        """Optimizer steps taken (seed 001's name)."""
        return self.optimizer_steps

    @contextlib.contextmanager
    def accumulation_context(self, model: torch.nn.Module | None = None) -> Iterator[Any]:
        """Seed 001's context around a training loop: on a normal exit the short last window is applied
        (flush()); when the body raises, the open window is dropped without a step and the error goes on."""
        if model is not None and self.attached and model is not self.module:
            raise ValueError("accumulation_context: the model passed is not the one this accumulator trains")
        try:
            yield self
        except BaseException:
            if self.attached:
                self.discard_window()
            raise
        if self.attached:
            self.flush()

    def update_config(self, *args: Any, **fields: Any) -> dict[str, Any]:
        """Seed 000's update_config(model, device_ids): a report on those devices, nothing changed.

        update_config(**fields): changes the window or the clipping between windows (UPDATABLE) and
        returns the changed fields; any other field, or a call mid-window, is an error.
        """
        if args:
            if fields or len(args) > 2 or not isinstance(args[0], torch.nn.Module):
                raise TypeError("update_config: call it as update_config(model, device_ids) or update_config(**fields)")
            ids = args[1] if len(args) > 1 else None
            if ids is not None and not isinstance(ids, Sequence):
                raise TypeError(f"update_config: device_ids must be a list of ints, got {type(ids).__name__}")
            return device_report(ids)
        bad = sorted(set(fields) - set(UPDATABLE))
        if bad:
            raise ValueError(
                f"update_config: {bad} cannot change on a built accumulator (they shape its buffers or loss "
                f"scale); build a new one. Changeable between windows: {UPDATABLE}"
            )
        if self.attached and self.micro_steps_in_window:
            raise RuntimeError(
                f"update_config: called mid-window ({self.micro_steps_in_window} micro-steps accumulated); "
                "call it right after a step, or flush() first"
            )
        config, core = self.config, _core_names(fields)
        # The config's own validation, on a copy; the steps are given now, not derived from the batch sizes.
        checked = dataclasses.replace(config, target_batch_size=None, micro_batch_size=None, **core)
        changed = {}
        for name in core:
            if getattr(checked, name) != getattr(config, name):
                changed[name] = getattr(checked, name)
                setattr(config, name, changed[name])
        if config.guide is not None:  # the stats' config echoes the guide's names with their new values
            config.guide.given.update(fields)
        if "accumulation_steps" in changed and config.micro_batch_size is not None:
            config.target_batch_size = None  # derived from the old window; effective_batch_size follows the new one
        return changed

    def get_accumulation_stats(self) -> dict[str, Any]:
        """Every statistic as host values, under gradacc_ext's names and the guides' (reads the device-side norm
        history: one sync)."""
        return all_stats(self)


def _core_names(fields: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in fields.items():
        target = ALIASES.get(name, name)
        if target in out and out[target] != value:
            raise ValueError(f"update_config: two spellings of {target} with different values")
        out[target] = value
    return out
