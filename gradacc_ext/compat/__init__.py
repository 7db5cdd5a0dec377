"""The accumulation guides' names over gradacc_ext: guide code runs with only its import lines changed to
`from gradacc_ext.compat import ...`.

GradientAccumulator and AdaptiveGradientAccumulator are gradacc_ext's own classes (one class each), which
take the guides' call shapes themselves (accumulate/guide_calls.py). GradientAccumulationConfig is
`gradacc_ext.GradientAccumulationConfig.from_guide`: it takes the guides' spellings and returns the one
config class (accumulate/guide_spellings.py resolves them). The rest are the guides' helpers over the
accumulator: create_accumulation_config, GradientAccumulationTrainer, GradientAccumulationManager and
MemoryMonitor.
"""

from ..accumulate import AdaptiveGradientAccumulator, GradientAccumulator
from ..accumulate.guide_devices import MemoryMonitor
from .config import GradientAccumulationConfig, create_accumulation_config
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
