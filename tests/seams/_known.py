"""THE one place where seam cells that fail on today's code are marked, each with the issue 27 finding that
explains it (xfail(strict=True): once the finding's fix is merged the cell passes, the mark fails the run,
and the line here is deleted)."""

from __future__ import annotations

from _table import Cell


def known_failure(cell: Cell) -> str:
    """The reason a cell is expected to fail today, or "" when it must pass."""
    return ""
