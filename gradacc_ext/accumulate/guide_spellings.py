"""The guides' GradientAccumulationConfig spellings, resolved in one place into gradacc_ext's fields.

The guides (seeds 000-004) name the same knobs differently and, for
`effective_batch_size`, mean different things. Every alias, every
guide-specific meaning and every field accepted without effect is decided
here, by `resolve_guide_fields`, which GradientAccumulationConfig.from_guide
(GuideConfig, its base class) calls: gradacc_ext.compat.GradientAccumulationConfig
is that classmethod; the dataclass constructor never sees a guide name.
docs/migration.md ("The guides' API") has the same mapping as a table.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from .precision import MIXED_PRECISION_SPELLINGS

log = logging.getLogger("gradacc_ext.compat")  # the guides' API's logger, which users and tests filter on

# guide field -> gradacc_ext field (same meaning, value passed through)
ALIASES = {
    "gradient_clipping": "max_grad_norm",  # seeds 000, 001
    "gradient_clip_norm": "max_grad_norm",  # seed 002
    "gradient_clip_value": "clip_value",  # seed 002
    "max_batch_size": "micro_batch_size",  # seed 002
}

STRATEGIES = ("standard", "dynamic", "adaptive")

# Accepted without effect, with the reason (logged once per config). "True"-only ones are what
# gradacc_ext always does; their False is an error (see ALWAYS_ON).
NO_EFFECT = {
    "log_accumulation": "statistics are always kept: get_accumulation_stats(), add_callback()",
    "log_memory_usage": "CUDA memory per step is recorded with track_memory=True",
    "log_frequency": "statistics are always kept: get_accumulation_stats(), add_callback()",
    "profile_accumulation": "times per micro-step and per step are always in get_accumulation_stats()",
    "memory_efficient": "the window is always held in one flat buffer per dtype and param.grad is dropped",
    "max_memory_usage": "the adaptive strategy reacts to out-of-memory errors, not to a usage threshold",
    "memory_safety_margin": "the adaptive strategy reacts to out-of-memory errors, not to a usage threshold",
    "memory_threshold": "the adaptive strategy reacts to out-of-memory errors, not to a usage threshold",
    "auto_adjust_batch_size": "the adaptive strategy splits a micro-batch that runs out of memory",
    "auto_adjust": "the adaptive strategy splits a micro-batch that runs out of memory",
    "gradient_scaling": (
        "the window's gradient is an exact mean, so nothing is rescaled; for the learning rate use "
        "gradacc_ext.planning.scale_lr_linear/scale_lr_sqrt, for loss scaling mixed_precision='fp16'"
    ),
}
ALWAYS_ON = {
    "clear_gradients": "gradients are always cleared after each micro-batch and each step",
    "sync_gradients": "under DDP the window is always all-reduced once, at its end",
    "sync_across_devices": "under DDP the window is always all-reduced once, at its end",
    "reduce_gradients": "under DDP the window is always all-reduced once, at its end",
    "automatic_scaling": "accumulation_steps is derived from the batch sizes whenever it is not given",
}
# Not supported: any value but the default is an error that names the gradacc_ext way.
UNSUPPORTED = {
    "warmup_steps": (0, "pass an LR scheduler as scheduler= (e.g. torch.optim.lr_scheduler.LinearLR)"),
    "accumulation_scheduler": (None, "the window is fixed; change it between windows with update_config()"),
    "gradient_checkpointing": (False, "enable it on the model (torch.utils.checkpoint)"),
}
DEFAULT_ACCUMULATION_STEPS = 4  # the default of every guide
# The guides' on/off knobs that describe what gradacc_ext always does: the stats' config echoes them as True
# when not given, so a guide reading config['memory_efficient'] finds it (seed 001's debug snippet).
ALWAYS_DOES = dict.fromkeys((*ALWAYS_ON, "memory_efficient", "log_accumulation", "profile_accumulation"), True)


@dataclass
class GuideFields:
    """The core fields resolved from a guide's keyword arguments, and what the guide asked for besides:
    the keywords as given (`given`, which update_config() keeps current), the strategy and the notes."""

    fields: dict[str, Any]
    strategy: str = "standard"
    given: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def echo(self, out: dict[str, Any], core_fields: Collection[str]) -> dict[str, Any]:
        """The config's to_dict() for a guide: the core fields, then every field the guide passed under its own
        name and as given (no-effect ones and effective_batch_size, in the guide's meaning, included), the knobs
        gradacc_ext always honours (ALWAYS_DOES) and the strategy. A core field keeps its resolved value
        (mixed_precision=True: 'fp16')."""
        out.update({k: v for k, v in ALWAYS_DOES.items() if k not in out})
        out.update({k: v for k, v in self.given.items() if k not in core_fields})
        out.update(strategy=self.strategy, adaptive_accumulation=self.strategy != "standard")
        return out

    def log_notes(self) -> None:
        """One log line for the fields accepted without effect, with the reasons (once the config is built)."""
        if self.notes:
            log.info(
                "GradientAccumulationConfig: accepted without effect: %s",
                "; ".join(f"{k} ({v})" for k, v in self.notes.items()),
            )


def _error(message: str) -> ValueError:
    return ValueError(f"GradientAccumulationConfig: {message}")


def _put(out: dict[str, Any], name: str, value: Any, source: str, given: dict[str, Any]) -> None:
    """Sets a core field; an alias and the field (or two aliases) with different values are an error."""
    if name in out and out[name] != value:
        first = next((k for k in given if k != source and ALIASES.get(k, k) == name), name)
        raise _error(f"{source}={value!r} and {first}={out[name]!r} both set {name} (the gradacc_ext field); give one")
    out[name] = value


def _mixed_precision(kw: dict[str, Any], out: dict[str, Any], given: dict[str, Any]) -> None:
    amp_dtype = kw.pop("amp_dtype", None)
    if "use_amp" in kw:  # seeds 002, 004: fp16 unless amp_dtype says otherwise
        use_amp = kw.pop("use_amp")
        if not isinstance(use_amp, bool):
            raise _error(f"use_amp must be True or False, got {use_amp!r}")
        _put(out, "mixed_precision", (amp_dtype or torch.float16) if use_amp else "no", "use_amp", given)
    elif amp_dtype is not None:
        raise _error("amp_dtype is only read with use_amp=True; or give mixed_precision=amp_dtype")
    mp = kw.pop("mixed_precision", None)
    if isinstance(mp, bool):  # seed 000: mixed_precision=True beside a GradScaler means fp16
        mp = "fp16" if mp else "no"
    if mp is not None:
        canonical = MIXED_PRECISION_SPELLINGS.get
        if "mixed_precision" in out and canonical(out["mixed_precision"], out["mixed_precision"]) != canonical(mp, mp):
            raise _error(f"mixed_precision={mp!r} and use_amp={given['use_amp']!r} disagree; give one")
        out["mixed_precision"] = mp


def _batch_sizes(kw: dict[str, Any], out: dict[str, Any], given: dict[str, Any]) -> None:
    """effective_batch_size means the per-step batch beside target_batch_size (seed 001), the whole batch
    beside max_batch_size or alone (seed 002)."""
    if "effective_batch_size" not in kw:
        return
    effective = kw.pop("effective_batch_size")
    if "target_batch_size" in kw and ("max_batch_size" in kw or "micro_batch_size" in kw):
        raise _error(
            "effective_batch_size with both target_batch_size and max_batch_size is ambiguous: beside "
            "target_batch_size it is the micro-batch (seed 001), beside max_batch_size the whole effective "
            "batch (seed 002); give micro_batch_size and target_batch_size instead"
        )
    if "target_batch_size" in kw:
        _put(out, "micro_batch_size", effective, "effective_batch_size", given)
    else:
        _put(out, "target_batch_size", effective, "effective_batch_size", given)


def _strategy(kw: dict[str, Any], given: dict[str, Any]) -> str:
    strategy = kw.pop("strategy", None)
    if strategy is not None and strategy not in STRATEGIES:
        raise _error(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    for flag, implied in (("adaptive_accumulation", "adaptive"), ("dynamic_accumulation", "dynamic")):
        if kw.pop(flag, False):
            if strategy not in (None, implied):
                raise _error(f"{flag}=True and strategy={strategy!r} disagree; give one")
            strategy = implied
    return strategy or "standard"


def resolve_guide_fields(kwargs: dict[str, Any], core_fields: Collection[str]) -> GuideFields:
    """Maps a guide's GradientAccumulationConfig(...) keywords onto gradacc_ext's fields (core_fields: the
    config's constructor fields; see the module doc)."""
    kw, given, out, notes = dict(kwargs), dict(kwargs), {}, {}
    for name, reason in NO_EFFECT.items():
        if name in kw:
            kw.pop(name)
            notes[name] = reason
    for name, reason in ALWAYS_ON.items():
        if name in kw:
            if kw.pop(name) is not True:
                raise _error(f"{name} can only be True: {reason}")
            notes[name] = reason
    for name, (default, way) in UNSUPPORTED.items():
        if name in kw and kw.pop(name) != default:
            raise _error(f"{name}={given[name]!r} is not supported: {way}")
    strategy = _strategy(kw, given)
    _mixed_precision(kw, out, given)
    _batch_sizes(kw, out, given)
    for name, target in ALIASES.items():
        if name in kw:
            _put(out, target, kw.pop(name), name, given)
    for name in list(kw):
        if name not in core_fields:
            raise _error(f"unknown field {name!r} (neither a gradacc_ext field nor a guide alias)")
        _put(out, name, kw.pop(name), name, given)
    if out.get("max_grad_norm") is not None and out["max_grad_norm"] == 0:
        out["max_grad_norm"] = None  # the guides' "no clipping" as well
    has_sizes = out.get("target_batch_size") is not None and out.get("micro_batch_size") is not None
    if out.get("accumulation_steps") is None and not has_sizes:
        out["accumulation_steps"] = DEFAULT_ACCUMULATION_STEPS
    return GuideFields(out, strategy, given, notes)


Config = TypeVar("Config", bound="GuideConfig")


class GuideConfig:
    """The guides' side of GradientAccumulationConfig (its base class): from_guide() and what it records."""

    guide: GuideFields | None  # the config's field: None unless built by from_guide()

    @classmethod
    def from_guide(cls: type[Config], **guide_fields: Any) -> Config:
        """The config from a guide's keywords (`gradacc_ext.compat.GradientAccumulationConfig`): the config's fields
        and the guides' spellings (docs/migration.md); without accumulation_steps or both batch sizes, 4 steps
        (every guide's default). The fields accepted without effect are logged once, with the reason."""
        resolved = resolve_guide_fields(guide_fields, [f.name for f in dataclasses.fields(cls) if f.init])
        config = cls(**resolved.fields)
        config.guide = resolved
        resolved.log_notes()
        return config

    @property
    def strategy(self) -> str:
        """The guides' "standard", "dynamic" or "adaptive": which accumulator their trainer and manager build."""
        return "standard" if self.guide is None else self.guide.strategy

    @property
    def guide_notes(self) -> dict[str, str]:
        """The guide fields from_guide() accepted without effect, each with the reason."""
        return {} if self.guide is None else self.guide.notes
