"""The op layer: fused multi-tensor ops, their checks, fake kernels and pure-PyTorch reference.

`gradacc_ext.ops.<op>` dispatches to the CUDA kernels, the C++ CPU kernels or the reference
(api.py); `reference` is the test oracle and the fallback; `_checks` validates arguments for
every backend; `_fake` registers the fake kernels; `_loader` loads the compiled extension.
"""

from ._checks import is_dense
from ._loader import build_info, extension_has_cuda, extension_loaded, runs_with
from .api import (
    BACKENDS,
    DEFAULT_EPS,
    accumulate_,
    accumulate_final_,
    clip_by_norm_,
    clip_by_value_,
    clip_grad_norm_,
    global_norm,
    resolve_backend,
    unscale_,
)
from .optim_api import adamw_step_, lion_step_, sgd_step_


def register_fake_kernels() -> None:
    """Registers the fake (meta) kernels of every op: torch.compile and FakeTensor tracing see their shapes."""
    from . import _fake

    _fake.register()


__all__ = [
    "BACKENDS",
    "DEFAULT_EPS",
    "accumulate_",
    "adamw_step_",
    "accumulate_final_",
    "build_info",
    "clip_by_norm_",
    "clip_by_value_",
    "clip_grad_norm_",
    "extension_has_cuda",
    "extension_loaded",
    "global_norm",
    "is_dense",
    "lion_step_",
    "register_fake_kernels",
    "resolve_backend",
    "runs_with",
    "sgd_step_",
    "unscale_",
]
