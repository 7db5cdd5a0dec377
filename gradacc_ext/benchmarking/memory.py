"""Peak CPU memory from a torch.profiler run: one reading shared by the memory benchmarks and tests."""

from __future__ import annotations

from torch.profiler import profile


def allocated_bytes(prof: profile) -> tuple[int, int]:
    """(peak, end) of bytes allocated minus freed during a `profile(profile_memory=True)` run.

    Replays the allocator's own events ("[memory]": one per allocation or free, each with its own timestamp)
    in time order. Per-op self memory ordered by op start is not enough: it puts a parent op's negative self
    memory (a temporary its child allocated and it freed) before the child's allocation, under-reading peaks.
    """
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak, live
