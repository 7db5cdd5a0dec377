"""THE one place where seam cells that fail on today's code are marked, each with the finding (issue 27's, or a
documented limit of a feature) that explains it: a rule here gives its cells xfail(strict=True), so once the
finding's fix is merged the cell passes, its strict mark fails the run, and the rule is deleted (findings 1 and 3
were marked here until their fixes reached main; so was fsdp_micro's mid-window checkpoint, a harness fault: the
snapshot before the load indexed the fresh optimizer's state, see _seam_cells.trained)."""

from __future__ import annotations

from collections.abc import Callable

from _seam_table import FSDP_MODES, Cell, verdict

KNOWN: tuple[tuple[Callable[[Cell], bool], str], ...] = (
    (
        lambda c: c.state_dtype == "bf16_states" and c.parallel in FSDP_MODES and verdict(c).kind == "equal",
        "bf16 optimizer states under FSDP2 / HSDP draw their stochastic rounding by the element's position in the "
        "rank's shard, not in the param, so they are not one process's bits (docs/optimizer-states.md: reproducible "
        "and resumed exactly at the same layout; int8 states on aligned shards are exact)",
    ),
)


def known_failure(cell: Cell) -> str:
    """The reason a cell is expected to fail today, or "" when it must pass."""
    return next((reason for applies, reason in KNOWN if applies(cell)), "")
