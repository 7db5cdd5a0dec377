"""The guides' config constructors: GradientAccumulationConfig(**guide_fields) and seed 002's
create_accumulation_config, both returning gradacc_ext's one GradientAccumulationConfig."""

from __future__ import annotations

from typing import Any

from ..accumulate.config import GradientAccumulationConfig as _Config

# The guides call GradientAccumulationConfig(gradient_clipping=1.0, ...): the one config class's from_guide,
# under the guides' name (the class itself takes only gradacc_ext's fields; see from_guide for the spellings).
GradientAccumulationConfig = _Config.from_guide


def create_accumulation_config(
    target_batch_size: int, max_batch_size: int, use_amp: bool = False, **kwargs: Any
) -> _Config:
    """Seed 002's helper: the window that reaches target_batch_size with micro-batches of max_batch_size."""
    return _Config.from_guide(
        target_batch_size=target_batch_size, max_batch_size=max_batch_size, use_amp=use_amp, **kwargs
    )
