"""Devices and the compiled-kernel check that test files import (conftest.py builds its fixtures on them)."""

from __future__ import annotations

import pytest
import torch

import gradacc_ext

CUDA_SKIP = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=CUDA_SKIP)]


def require_ext(device: str) -> None:
    """Skips the calling test when no compiled kernels exist for `device` (e.g. a GRADACC_NO_EXT build)."""
    try:
        gradacc_ext.resolve_backend(device, "ext")
    except RuntimeError as exc:
        pytest.skip(str(exc))
