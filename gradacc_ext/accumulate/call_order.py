"""The order of GradientAccumulator's calls: where the caller is in a micro-step, and what each place refuses.

micro_step() is not nested; backward() runs once per micro_step() (and inside one under DDP, which decides
during forward whether to all-reduce); flush(), discard_window() and state_dict() run between micro-steps.
A backward that failed after adding into earlier micro-steps' sums loses the open window: micro_step(),
backward() and flush() then refuse until discard_window() or load_state_dict() replaces it. Each refusal
comes before the call changes anything.
"""

from __future__ import annotations


class CallOrder:
    """The accumulator's call-order state: inside a micro-step or not, and whether the open window was lost."""

    def __init__(self) -> None:
        self.in_micro_step = False
        self.closing = False  # micro_step(last=True): this micro-batch closes the window
        self.backward_done = False
        self.window_lost = False  # a failed backward discarded the open window: refuse until it is replaced

    def enter_micro_step(self, last: bool) -> None:
        if self.in_micro_step:
            raise RuntimeError("GradientAccumulator.micro_step() cannot be nested")
        self.in_micro_step, self.backward_done, self.closing = True, False, bool(last)

    def leave_micro_step(self) -> None:
        self.in_micro_step = self.closing = False

    def check_backward(self, needs_context: bool, closed: bool) -> None:
        """backward()'s refusals, in order; needs_context: the strategy decides in forward (DDP)."""
        if needs_context and not self.in_micro_step:
            raise RuntimeError(
                "GradientAccumulator.backward: with a DistributedDataParallel model the forward and backward must "
                "run inside `with acc.micro_step():` (DDP decides during forward whether to all-reduce)"
            )
        if closed:
            raise RuntimeError("GradientAccumulator.backward: the accumulator is closed")
        self.refuse_lost_window("backward")
        if self.in_micro_step and self.backward_done:
            raise RuntimeError("GradientAccumulator.backward: called twice inside one micro_step()")

    def refuse_inside_micro_step(self, where: str, advice: str = "") -> None:
        """`where` runs between micro-steps; advice (e.g. "; call it after the micro-batch") ends the message."""
        if self.in_micro_step:
            raise RuntimeError(f"GradientAccumulator.{where}: called inside micro_step(){advice}")

    def refuse_lost_window(self, where: str) -> None:
        """Going on after a lost window (a retried micro-batch) would close a window without the earlier
        micro-batches, silently wrong (the seam matrix, tests/seams), so the caller must drop it knowingly."""
        if self.window_lost:
            raise RuntimeError(
                f"GradientAccumulator.{where}: the open window was lost: a backward failed after part of its "
                "gradient was added into earlier micro-steps' sums, which cannot be undone exactly without a copy "
                "of them (docs/memory.md), so a retry would close a window without those micro-batches. Call "
                "discard_window() to drop it and start a new window, or restart from the last checkpoint "
                "(AdaptiveGradientAccumulator.step_batch runs the window again itself)"
            )
