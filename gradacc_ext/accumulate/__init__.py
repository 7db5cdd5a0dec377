"""The accumulation window: the accumulator, its buffers, loss scaling, config, stats and the
adaptive (OOM-splitting) variant."""

from .accumulator import GradientAccumulator
from .adaptive import AdaptiveGradientAccumulator
from .config import GradientAccumulationConfig
from .stats import StepInfo

__all__ = ["AdaptiveGradientAccumulator", "GradientAccumulationConfig", "GradientAccumulator", "StepInfo"]
