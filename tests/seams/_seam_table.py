"""The seam matrix (issue 27, section 2): its dimensions, the ONE table of what is supported, refused or not
built, and the cells CI runs (a deterministic pairwise covering array plus the product of the most used subset).

Every cell that runs must equal the plain loop on the same samples, or be refused with a clear error before
anything is written. scripts/seams_doc.py writes docs/seams.md from this module; test_seams_doc.py checks
the committed page equals it.
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

# Each dimension's values, in a fixed order (the covering array and the docs follow it).
DIMENSIONS: dict[str, tuple[str, ...]] = {
    "path": ("hooks", "fusion", "views", "adaptive"),
    "parallel": ("local", "ddp_buffer", "ddp_overlap", "fsdp_window", "fsdp_micro", "hsdp"),
    "precision": ("fp32", "bf16", "fp16_own", "fp16_user"),
    "entry": ("core", "compat", "lightning", "accelerate"),
    "optimizer": ("fused_adamw", "fused_lion", "adamw", "sgd"),
    "event": ("none", "oom_forward", "oom_backward", "short_window", "checkpoint", "slow_peer"),
    "state_dtype": ("fp32_states", "bf16_states", "int8_states"),
}

MEANING: dict[str, str] = {
    "hooks": "gradient hooks fold into flat buffers (the default)",
    "fusion": "`gradient_accumulation_fusion=True`",
    "views": "`grad_views=True`",
    "adaptive": "`AdaptiveGradientAccumulator.step_batch`, 2-row chunks",
    "local": "one process",
    "ddp_buffer": "DDP, `ddp_reduce='buffer'` (2 ranks)",
    "ddp_overlap": "DDP, `ddp_reduce='overlap'` (2 ranks)",
    "fsdp_window": "FSDP2 `fully_shard`, `fsdp_reduce='window'` (2 ranks)",
    "fsdp_micro": "FSDP2 `fully_shard`, `fsdp_reduce='micro_step'` (2 ranks)",
    "hsdp": "HSDP, a 2 x 2 mesh (4 ranks)",
    "fp32": "fp32 path, run in float64",
    "bf16": "bf16 autocast, fp32 parameters and accumulation",
    "fp16_own": "fp16 autocast, the accumulator's loss scaler",
    "fp16_user": "fp16 autocast, the user's `GradScaler`",
    "core": "`gradacc_ext.GradientAccumulator`",
    "compat": "the guides' API, `gradacc_ext.compat` (`GradientAccumulator(config)`, `accumulate_gradients`)",
    "lightning": "`GradientAccumulatorCallback` in a Lightning `Trainer` (`fp16_user`: its '16-mixed' plugin's scaler)",
    "accelerate": "the accumulator over `Accelerator.prepare`d model, optimizer and loader",
    "fused_adamw": "`gradacc_ext.optim.FusedAdamW`",
    "fused_lion": "`gradacc_ext.optim.FusedLion`",
    "adamw": "`torch.optim.AdamW`",
    "sgd": "`torch.optim.SGD` with momentum",
    "none": "no event",
    "oom_forward": "an OOM in forward on every rank, caught and the micro-batch retried",
    "oom_backward": "an OOM mid-backward (after the last Linear's gradients) on every rank, caught and retried",
    "short_window": "a short last window, applied by `flush()`",
    "checkpoint": "a checkpoint saved mid-window, resumed in a fresh process",
    "slow_peer": "rank 0 is slow (longer than a shortened peer-watch stall limit) but healthy",
    "fp32_states": "the optimizer's states in its parameters' dtype (torch's; the fused optimizers' default)",
    "bf16_states": "a fused optimizer with `state_dtype='bf16'` (stochastic rounding from its seed)",
    "int8_states": "a fused optimizer with `state_dtype='int8'`, `int8_min_numel=0`, a 512-wide hidden layer "
    "(its Linear block-aligned on 2 ranks; the last Linear is not, so FSDP2 keeps it in fp32 states)",
}

# The product CI runs in full: the most used subset (the other dimensions at their first value, but
# the optimizer at torch's AdamW, the most used one).
PRODUCT_SUBSET: dict[str, tuple[str, ...]] = {
    "path": ("hooks", "fusion"),
    "parallel": ("local", "ddp_buffer"),
    "precision": ("fp32", "bf16"),
    "entry": ("core",),
    "optimizer": ("adamw",),
    "event": DIMENSIONS["event"],
    "state_dtype": ("fp32_states",),
}


class Cell(NamedTuple):
    path: str
    parallel: str
    precision: str
    entry: str
    optimizer: str
    event: str
    state_dtype: str = "fp32_states"

    @property
    def id(self) -> str:
        """The values joined by "-"; the default state_dtype is left out (the ids before it was a dimension)."""
        return "-".join(self if self.state_dtype != "fp32_states" else self[:-1])


class Verdict(NamedTuple):
    kind: str  # "equal" (must equal the plain loop), "refused" (a clear error before any write), "absent"
    reason: str
    match: str = ""  # "refused": a regular expression the error message must match


COLLECTIVE_MODES = ("ddp_overlap", "fsdp_window", "fsdp_micro", "hsdp")
FSDP_MODES = ("fsdp_window", "fsdp_micro", "hsdp")


def verdict(cell: Cell) -> Verdict:
    """THE table: what each combination must do. Rules are checked in order; the first that applies decides."""
    c = cell
    # -- no such combination (low-bit states are the fused optimizers', for float32 params) --
    if c.state_dtype != "fp32_states" and not c.optimizer.startswith("fused_"):
        return Verdict("absent", "torch's optimizers have no state_dtype: only the fused ones store low-bit states")
    if c.state_dtype != "fp32_states" and c.precision == "fp32":
        return Verdict("absent", "the fp32 path runs float64 params, which keep float64 states whatever state_dtype "
                       "says (docs/optimizer-states.md): the cell is its fp32_states one")  # fmt: skip
    # -- not built by this harness (listed on the docs page, so the gap is visible) --
    if c.entry == "lightning" and c.parallel in FSDP_MODES:
        return Verdict("absent", "the callback refuses every strategy but Lightning's single-device and DDP ones at "
                       "fit start (tests/frameworks/test_lightning_seams.py); not built here")  # fmt: skip
    if c.entry == "lightning" and c.path == "adaptive":
        return Verdict("absent", "the callback builds the core GradientAccumulator")
    if c.entry == "accelerate" and c.parallel in FSDP_MODES:
        return Verdict("absent", "the Accelerator's FSDP plugin is not built by the harness")
    # -- refused by the configuration (before anything is built) --
    if c.path == "fusion" and c.parallel == "ddp_overlap":
        return Verdict("refused", "the fused Linears never fill param.grad, which DDP's reducer reads",
                       r"gradient_accumulation_fusion=True cannot be combined with ddp_reduce='overlap'")  # fmt: skip
    if c.entry == "lightning" and c.parallel == "ddp_overlap":
        return Verdict("refused", "Lightning prepares DDP's reducer only in manual_backward(), not in the "
                       "accumulator's backward", r"ddp_reduce='overlap' needs DDP's reducer")  # fmt: skip
    if c.entry == "lightning" and c.parallel == "ddp_buffer" and c.event == "checkpoint":
        return Verdict("refused", "Lightning saves rank 0's checkpoint alone, and an open window's sums are each "
                       "rank's own: trainer.save_checkpoint() mid-window is refused (at a window boundary it "
                       "resumes exactly, tests/frameworks)",
                       r"Lightning saves rank 0's checkpoint alone.*checkpoint at a window boundary")  # fmt: skip
    # before the next rule: under DDP overlap the OOM in a micro-batch's second chunk is refused before the split is
    if c.path == "adaptive" and c.parallel in COLLECTIVE_MODES and c.event in ("oom_forward", "oom_backward"):
        return Verdict("refused", "collectives run inside the micro-step: one rank cannot split alone",
                       r"so this rank cannot split alone")  # fmt: skip
    if c.path == "adaptive" and c.parallel == "ddp_overlap":
        return Verdict("refused", "DDP reduces during the closing backward; a micro-batch split in chunks has several",
                       r"split micro-batches \(AdaptiveGradientAccumulator\) need ddp_reduce='buffer'")  # fmt: skip
    if c.parallel == "ddp_overlap" and c.event == "oom_backward":
        return Verdict("refused", "the closing backward raised part-way: DDP's reducer is mid-reduction and the "
                       "window's sums (param.grad) hold part of it, so the retry is refused",
                       r"with ddp_reduce='overlap' the window's closing backward raised part-way")  # fmt: skip
    if c.parallel in ("local", "ddp_buffer") and c.event == "oom_backward" and c.path != "adaptive":
        return Verdict("refused", "the failed backward had added into the earlier micro-step's sums, which cannot "
                       "be undone without a copy: the retry is refused until discard_window() (adaptive: "
                       "step_batch runs the window again, exact)", r"the open window was lost")  # fmt: skip
    if c.parallel in FSDP_MODES and c.event == "oom_backward":
        return Verdict("refused", "a backward that raised leaves FSDP2 mid-backward: the retry is refused",
                       r"FSDP2 was left mid-backward")  # fmt: skip
    if c.parallel in ("fsdp_window", "hsdp") and c.event == "checkpoint":
        return Verdict("refused", "FSDP2 still holds the open window's partly reduced gradients (fsdp_reduce='window', "
                       "or HSDP's replicate dimension): a mid-window checkpoint is refused; fsdp_micro on a 1-D mesh "
                       "saves mid-window", r"cannot take a mid-window checkpoint here")  # fmt: skip
    return Verdict("equal", "equals the plain loop")


# -- the cells CI runs ----------------------------------------------------------------------------------------------


@functools.cache
def all_cells() -> tuple[Cell, ...]:
    return tuple(Cell(*values) for values in itertools.product(*DIMENSIONS.values()))


def pairs_of(cell: Cell) -> set[tuple[int, str, int, str]]:
    return {(i, cell[i], j, cell[j]) for i, j in itertools.combinations(range(len(cell)), 2)}


@functools.cache
def pairwise_cells() -> tuple[Cell, ...]:
    """A greedy pairwise covering array over the cells that are built (verdict not "absent"): every pair of
    values of any two dimensions that some built cell holds appears in at least one chosen cell.

    Deterministic: candidates in product order, ties to the first; each pick covers the most uncovered pairs.
    """
    built = [c for c in all_cells() if verdict(c).kind != "absent"]
    uncovered = set().union(*(pairs_of(c) for c in built))
    chosen: list[Cell] = []
    while uncovered:
        best = max(built, key=lambda c: len(pairs_of(c) & uncovered))
        chosen.append(best)
        uncovered -= pairs_of(best)
    return tuple(chosen)


def product_cells() -> list[Cell]:
    return [Cell(*values) for values in itertools.product(*PRODUCT_SUBSET.values())]


# Cells that pin what the matrix found (each failed before its fix), run whatever the covering array picks.
REGRESSION_CELLS = (
    Cell("hooks", "ddp_overlap", "fp32", "core", "sgd", "oom_backward"),  # retry after a failed closing backward
    Cell("hooks", "fsdp_micro", "fp32", "core", "sgd", "oom_backward"),  # FSDP2 left mid-backward
    Cell("adaptive", "hsdp", "bf16", "core", "adamw", "none"),  # chunks sharing autocast's cast cache
    Cell("hooks", "local", "fp32", "accelerate", "fused_adamw", "none"),  # AcceleratedOptimizer in fused_step_for
    Cell("adaptive", "local", "bf16", "core", "fused_adamw", "oom_backward"),  # the plain loop's chunks after a replay
    Cell("adaptive", "ddp_overlap", "fp32", "core", "adamw", "oom_forward"),  # which refusal comes first
)


# Lightning's trainer.save_checkpoint() with the window open, resumed by a fresh Trainer (ckpt_path): in one process in
# float64, with the accumulator's fp16 scaler and with Lightning's 16-mixed scaler; under DDP refused before the write.
LIGHTNING_MID_WINDOW_CELLS = (
    Cell("hooks", "local", "fp32", "lightning", "fused_adamw", "checkpoint"),
    Cell("fusion", "local", "fp16_own", "lightning", "adamw", "checkpoint"),
    Cell("views", "local", "fp16_user", "lightning", "sgd", "checkpoint"),
    Cell("hooks", "ddp_buffer", "fp32", "lightning", "adamw", "checkpoint"),
)


# Low-bit optimizer states (issue 30) through every seam a fused optimizer meets, in both low-bit storages: the fused
# tail in one process, its checkpoint and its window replay (adaptive), DDP with an OOM retry and a resume, FSDP2
# and HSDP with a DCP resume, and the framework entries. The covering array adds each storage's pairs beyond these.
LOW_BIT_SEAMS = (
    ("hooks", "local", "bf16", "core", "fused_adamw", "none"),
    ("fusion", "local", "fp16_own", "compat", "fused_lion", "checkpoint"),
    ("adaptive", "local", "bf16", "core", "fused_adamw", "oom_backward"),
    ("hooks", "ddp_buffer", "bf16", "core", "fused_adamw", "oom_forward"),
    ("views", "ddp_overlap", "fp16_user", "core", "fused_adamw", "checkpoint"),
    ("hooks", "fsdp_window", "bf16", "core", "fused_adamw", "checkpoint"),
    ("fusion", "fsdp_micro", "bf16", "compat", "fused_lion", "short_window"),
    ("hooks", "hsdp", "bf16", "core", "fused_adamw", "checkpoint"),
    ("hooks", "ddp_buffer", "bf16", "lightning", "fused_adamw", "oom_forward"),
    ("hooks", "ddp_buffer", "bf16", "accelerate", "fused_adamw", "checkpoint"),
)
LOW_BIT_CELLS = tuple(Cell(*seam, state) for state in ("bf16_states", "int8_states") for seam in LOW_BIT_SEAMS)


def ci_cells() -> list[Cell]:
    """The pairwise cells, the product subset's, the regression cells, the low-bit ones and Lightning's mid-window
    checkpoints, without repeats, in a fixed order."""
    cells = [*pairwise_cells(), *product_cells(), *REGRESSION_CELLS, *LOW_BIT_CELLS, *LIGHTNING_MID_WINDOW_CELLS]
    return list(dict.fromkeys(cells))


def uncovered_pairs() -> list[tuple[str, str, str, str]]:
    """Pairs of values that no built cell holds (only in "absent" cells): named on the docs page."""
    built = set().union(*(pairs_of(c) for c in all_cells() if verdict(c).kind != "absent"))
    every = set().union(*(pairs_of(c) for c in all_cells()))
    names = list(DIMENSIONS)
    return sorted((names[i], a, names[j], b) for i, a, j, b in every - built)
