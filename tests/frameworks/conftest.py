"""The framework versions these tests run on, in pytest's header (`pytest tests/frameworks`)."""

from __future__ import annotations

import importlib.metadata

PACKAGES = ("lightning", "transformers", "accelerate", "torch")


def pytest_report_header() -> str:
    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} absent (its tests skip)")
    return "frameworks: " + ", ".join(found)
