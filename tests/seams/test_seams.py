"""The seam matrix in CI (issue 27, section 2): each cell equals the plain loop on the same samples, or is
refused with a clear error before anything is written (_seam_table.verdict says which).

The cells of one parallelism mode run together in one group of forked ranks (_seam_groups.py), the first time a
test of that mode asks; each cell is then its own test, so a failure names its cell. Known failures are
marked in ONE place, _seam_known.py.
"""

from __future__ import annotations

import importlib.util

import pytest
from _seam_groups import run_group
from _seam_known import known_failure
from _seam_table import Cell, ci_cells, verdict

GROUP_TIMEOUT_S = 240  # a hang fails the cells it stopped, not the whole run


# The framework an entry drives; CI's wheel stage runs these tests in a venv without them (the source stage
# installs tests/frameworks/requirements.txt), so those cells skip there instead of failing on the import.
FRAMEWORK_OF_ENTRY = {"lightning": "lightning", "accelerate": "accelerate"}


def _missing_framework(cell: Cell) -> str | None:
    module = FRAMEWORK_OF_ENTRY.get(cell.entry)
    return module if module and importlib.util.find_spec(module) is None else None


def _param(cell: Cell):
    marks = [] if cell.parallel == "local" else [pytest.mark.distributed]
    missing = _missing_framework(cell)
    if missing:
        marks.append(pytest.mark.skip(reason=f"{missing} is not installed (tests/frameworks/requirements.txt)"))
    reason = known_failure(cell)
    if reason:
        marks.append(pytest.mark.xfail(strict=True, reason=reason))
    return pytest.param(cell, id=cell.id, marks=marks)


CELLS = [c for c in ci_cells() if verdict(c).kind != "absent"]


@pytest.fixture(scope="session")
def group_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Per parallelism mode, computed on first use: every CI cell of that mode, in one group of ranks; cells
    with a checkpoint event resume in a second group (fresh processes)."""
    cache: dict[str, dict[str, dict]] = {}

    def results(parallel: str) -> dict[str, dict]:
        if parallel not in cache:
            out = str(tmp_path_factory.mktemp(parallel))
            cells = [c for c in CELLS if c.parallel == parallel and not _missing_framework(c)]
            cells.sort(key=lambda c: c.event == "slow_peer")  # last: a watch that ended a rank would stop the group
            cache[parallel] = run_group(parallel, cells, "run", out, GROUP_TIMEOUT_S)
            resumed = [c for c in cells if c.event == "checkpoint" and cache[parallel][c.id]["message"] == "saved"]
            if resumed:
                cache[parallel].update(run_group(parallel, resumed, "resume", out, GROUP_TIMEOUT_S))
        return cache[parallel]

    return results


@pytest.mark.parametrize("cell", [_param(c) for c in CELLS])
def test_cell_equals_plain_loop_or_is_refused(cell: Cell, group_results) -> None:
    row = group_results(cell.parallel)[cell.id]
    assert row["ok"], f"{cell.id}: {row['message']}\nwarnings: {row['warnings']}"
