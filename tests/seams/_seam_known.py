"""THE one place where seam cells that fail on today's code are marked, each with the issue 27 finding that
explains it (xfail(strict=True): once the finding's fix is merged the cell passes, its strict mark fails
the run, and the rule here is deleted)."""

from __future__ import annotations

from _seam_table import Cell

FINDING_3 = (
    "issue 27 finding 3: a backward that fails part-way makes Backprop.abort discard the whole open window "
    "(a RuntimeWarning), so the retried window is wrong; on the core path too, against micro_step()'s "
    "docstring ('the window is left as it was'); the window-sums transaction fixes it"
)


def known_failure(cell: Cell) -> str:
    """The reason a cell is expected to fail today, or "" when it must pass."""
    if cell.event == "oom_backward" and cell.parallel in ("local", "ddp_buffer"):
        return FINDING_3
    return ""
