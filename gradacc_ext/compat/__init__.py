"""The guides' API over gradacc_ext: their config names, call shapes and helper classes.

Guide code runs with only its import lines changed to `from gradacc_ext.compat import ...`.
Everything here is a thin layer over the core accumulators (gradacc_ext.accumulate):
entry_points.py adds the guides' entry points that gradacc_ext.GradientAccumulator itself keeps
(GradientAccumulator(config) then attach(), accumulate_gradients, get_accumulation_stats), and
accumulator.py the rest of the guides' call shapes; the aliases and the guides' disagreements are
resolved in compat.config.
"""

from .accumulator import AdaptiveGradientAccumulator, GradientAccumulator
from .config import GradientAccumulationConfig, create_accumulation_config
from .devices import MemoryMonitor
from .manager import GradientAccumulationManager
from .trainer import GradientAccumulationTrainer

__all__ = [
    "AdaptiveGradientAccumulator",
    "GradientAccumulationConfig",
    "GradientAccumulationManager",
    "GradientAccumulationTrainer",
    "GradientAccumulator",
    "MemoryMonitor",
    "create_accumulation_config",
]
