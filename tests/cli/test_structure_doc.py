"""docs/structure.md is what scripts/import_graph.py draws from today's imports, and no two subpackages of
gradacc_ext import each other (directly or in a circle)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "import_graph.py"
if not SCRIPT.exists():  # CI's wheel stage runs a copy of tests/ without the source tree
    pytest.skip("needs the source tree (scripts/import_graph.py)", allow_module_level=True)

spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
import_graph = importlib.util.module_from_spec(spec)
spec.loader.exec_module(import_graph)


def test_page_is_current() -> None:
    assert import_graph.PAGE.read_text() == import_graph.render(), (
        "docs/structure.md is stale: run `python scripts/import_graph.py`"
    )


def test_no_circle_between_subpackages() -> None:
    assert import_graph.cycles(import_graph.edges(1)) == []


def test_cycles_finds_a_circle_through_a_third_node() -> None:
    from collections import Counter

    graph = Counter({("a", "b"): 1, ("b", "c"): 2, ("c", "a"): 1, ("c", "d"): 1})
    assert import_graph.cycles(graph) == [("a", "b"), ("a", "c"), ("b", "c")]


def test_relative_from_import_names_the_submodule() -> None:
    """`from .. import ops` inside accumulate/ imports gradacc_ext.ops, not the package's __init__."""
    imported = import_graph.imports_of(import_graph.PACKAGE / "accumulate" / "buffers.py")
    assert "gradacc_ext.ops" in imported and "gradacc_ext" not in imported
