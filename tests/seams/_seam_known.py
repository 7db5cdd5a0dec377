"""THE one place where seam cells that fail on today's code are marked, each with the issue 27 finding that
explains it: a rule here gives its cells xfail(strict=True), so once the finding's fix is merged the cell
passes, its strict mark fails the run, and the rule is deleted. Empty: every CI cell passes on this branch
(findings 1 and 3 were marked here until their fixes reached main)."""

from __future__ import annotations

from collections.abc import Callable

from _seam_table import Cell

KNOWN: tuple[tuple[Callable[[Cell], bool], str], ...] = ()


def known_failure(cell: Cell) -> str:
    """The reason a cell is expected to fail today, or "" when it must pass."""
    return next((reason for applies, reason in KNOWN if applies(cell)), "")
