"""The seam matrix's table and cells (no process is started): the covering array covers every pair, CI holds
the product subset, every refusal names its message, and docs/seams.md is what scripts/seams_doc.py writes."""

from __future__ import annotations

from pathlib import Path

import pytest
from _seam_page import render
from _seam_table import (
    DIMENSIONS,
    LOW_BIT_CELLS,
    all_cells,
    ci_cells,
    pairs_of,
    pairwise_cells,
    product_cells,
    verdict,
)

PAGE = Path(__file__).resolve().parents[2] / "docs" / "seams.md"


def test_pairwise_cells_cover_every_pair_a_built_cell_holds() -> None:
    built = [c for c in all_cells() if verdict(c).kind != "absent"]
    wanted = set().union(*(pairs_of(c) for c in built))
    covered = set().union(*(pairs_of(c) for c in pairwise_cells()))
    assert wanted <= covered, sorted(wanted - covered)[:5]
    assert all(verdict(c).kind != "absent" for c in pairwise_cells())
    every_value = {(i, v) for i, values in enumerate(DIMENSIONS.values()) for v in values}
    assert every_value <= {(i, c[i]) for c in pairwise_cells() for i in range(len(c))}


def test_pairwise_generator_is_deterministic_and_ci_holds_the_product() -> None:
    assert pairwise_cells.__wrapped__() == pairwise_cells()
    cells = ci_cells()
    assert len(cells) == len(set(cells)) and set(product_cells()) <= set(cells)
    assert len(product_cells()) == 2 * 2 * 2 * len(DIMENSIONS["event"])


def test_every_refusal_names_the_message_it_must_raise() -> None:
    refused = {verdict(c) for c in all_cells() if verdict(c).kind == "refused"}
    assert refused and all(v.match and v.reason for v in refused)


@pytest.mark.skipif(not PAGE.exists(), reason="needs the source tree's docs/ (CI's wheel run tests a copy of tests/)")
def test_docs_page_is_generated_from_the_table() -> None:
    assert PAGE.read_text() == render(), "docs/seams.md is stale: run `python scripts/seams_doc.py`"


def test_low_bit_cells_are_built_run_in_ci_and_cover_every_seam() -> None:
    assert all(verdict(c).kind != "absent" for c in LOW_BIT_CELLS) and set(LOW_BIT_CELLS) <= set(ci_cells())
    for state in ("bf16_states", "int8_states"):
        cells = [c for c in LOW_BIT_CELLS if c.state_dtype == state]
        for name in ("parallel", "entry", "event"):
            i = list(DIMENSIONS).index(name)
            assert {c[i] for c in cells} >= set(DIMENSIONS[name]) - {"slow_peer", "short_window", "compat"}, name
