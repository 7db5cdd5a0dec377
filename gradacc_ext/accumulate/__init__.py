"""The accumulation window: the accumulator, its buffers, loss scaling, config, stats and the
adaptive (OOM-splitting) variant. GradientAccumulator, AdaptiveGradientAccumulator and
GradientAccumulationConfig here are the package's only classes of those names (gradacc_ext and
gradacc_ext.compat export these same ones)."""

from .accumulator import GradientAccumulator
from .adaptive import AdaptiveGradientAccumulator
from .config import GradientAccumulationConfig
from .stats import StepInfo

__all__ = ["AdaptiveGradientAccumulator", "GradientAccumulationConfig", "GradientAccumulator", "StepInfo"]
