"""Every test that needs CUDA has "cuda" in its id, or scripts/gpu_verify.sh would not run it.

The GPU run selects the suite's CUDA cases with `-k cuda`; a CUDA test whose id lacks the word
would be dropped silently there (and skipped on every CPU-only machine). tests/conftest.py fails
the collection on such a test. A test needs CUDA when it carries a skip mark whose reason names
CUDA (conftest.CUDA_SKIP) or is parametrized with a CUDA device. RUN_BY_PATH: files that
gpu_verify.sh runs by their path (its GPU_CHECKS), not by -k.
"""

from __future__ import annotations

import pytest
import torch

RUN_BY_PATH = {"test_gpu_checks.py"}


def _is_cuda(value: object) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and (value == "cuda" or value.startswith("cuda:"))


def needs_cuda(item: pytest.Item) -> bool:
    for mark in item.iter_markers("skipif"):
        if "cuda" in str(mark.kwargs.get("reason", "")).lower():
            return True
    callspec = getattr(item, "callspec", None)
    return callspec is not None and any(_is_cuda(v) for v in callspec.params.values())


def cuda_tests_without_cuda_id(items: list[pytest.Item]) -> list[str]:
    return [
        item.nodeid
        for item in items
        if item.path.name not in RUN_BY_PATH and needs_cuda(item) and "cuda" not in item.nodeid.lower()
    ]
