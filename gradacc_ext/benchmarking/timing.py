"""Timing, copy bandwidth, launch counting and host-sync checks.

Timing: CUDA events around each repeat on CUDA, time.perf_counter on the CPU
(CPU ops are synchronous), after a warm-up, median over many repeats.
Repeat i runs on input set i % n_sets, and there are enough sets that they
move as many bytes as the copy reference: far more than the last-level cache.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

MAX_SETS = 8
CPU_CACHE_FALLBACK = 32 << 20
TIMING_BATCH = 10  # CUDA repeats recorded between two host synchronisations


@dataclass(frozen=True)
class TimingConfig:
    warmup: int = 3
    min_reps: int = 10
    max_reps: int = 200
    min_time_s: float = 1.0  # keep repeating (up to max_reps) until this much was timed

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.min_reps < 1 or self.max_reps < self.min_reps or self.min_time_s < 0:
            raise ValueError(f"invalid timing config {self}: need warmup >= 0, 1 <= min_reps <= max_reps, time >= 0")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cache_bytes(device: torch.device) -> int:
    """The last-level cache that input sets must exceed: L2 on a GPU, the largest CPU cache otherwise."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size)
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * mult)
    return max(sizes, default=CPU_CACHE_FALLBACK)


def rotation_bytes(device: torch.device) -> int:
    """Bytes the rotated input sets must move together: as many as the copy reference.

    At least 8x the reported last-level cache, and a floor on top, because a
    virtual machine may report less cache than the host has (on this 2-core
    VM a 78 MB set that fit the real cache ran at 3x the copy bandwidth).
    """
    floor = 1 << 30 if device.type == "cuda" else 1 << 28
    return max(floor, 8 * cache_bytes(device))


def sets_needed(bytes_per_set: int, device: torch.device) -> int:
    """Input sets to rotate so that together they move at least rotation_bytes (at most MAX_SETS)."""
    return max(1, min(MAX_SETS, math.ceil(rotation_bytes(device) / max(1, bytes_per_set))))


def _time_batch(fn: Callable[[int], object], first: int, count: int, device: torch.device) -> list[float]:
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(count)]
        for k, (start, end) in enumerate(events):
            start.record()
            fn(first + k)
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) / 1e3 for start, end in events]
    out = []
    for k in range(count):
        t0 = time.perf_counter()
        fn(first + k)
        out.append(time.perf_counter() - t0)
    return out


def time_interleaved(
    fns: dict[str, Callable[[int], object]], device: torch.device, cfg: TimingConfig
) -> dict[str, list[float]]:
    """Seconds per repeat of each fn(i), i counting up from 0 through the warm-up and the repeats.

    The implementations take turns (one repeat each on the CPU, a batch of
    TIMING_BATCH on CUDA), so a change in machine load during the run hits
    all of them alike instead of biasing the ratios between them.
    """
    for fn in fns.values():
        for i in range(cfg.warmup):
            fn(i)
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in fns}

    def done(ts: list[float]) -> bool:
        return len(ts) >= cfg.max_reps or (len(ts) >= cfg.min_reps and sum(ts) >= cfg.min_time_s)

    while active := [name for name in fns if not done(times[name])]:
        for name in active:
            count = min(TIMING_BATCH if device.type == "cuda" else 1, cfg.max_reps - len(times[name]))
            times[name] += _time_batch(fns[name], cfg.warmup + len(times[name]), count, device)
    return times


def summarize(times: list[float]) -> dict[str, float]:
    q = statistics.quantiles(times, n=10) if len(times) > 1 else [times[0]] * 9
    return {"median_s": statistics.median(times), "p10_s": q[0], "p90_s": q[-1], "reps": len(times)}


class CopyReference:
    """A large fp32 dst.copy_(src), charged bytes read plus written, timed like every cell.

    Each cell times it interleaved with its implementations, so "% of copy"
    compares numbers taken under the same machine conditions.
    """

    def __init__(self, device: torch.device, nbytes: int) -> None:
        n = max(1, nbytes // 4)  # src is nbytes; one copy moves twice that
        gen = torch.Generator(device=device).manual_seed(12345)
        self.src = torch.empty(n, dtype=torch.float32, device=device).normal_(generator=gen)
        self.dst = torch.empty_like(self.src)
        self.bytes = 2 * n * 4

    def __call__(self, _i: int) -> None:
        self.dst.copy_(self.src)

    def gbps(self, times: list[float]) -> float:
        return self.bytes / summarize(times)["median_s"] / 1e9


def count_launches(fn: Callable[[], object], device: torch.device) -> tuple[int, str]:
    """Device operations (kernels, memcpy, memset) on CUDA; dispatched aten/gradacc ops on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    if device.type == "cuda":
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), "device launches"
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    return sum(1 for n in names if n.startswith(("aten::", "gradacc::"))), "dispatched ops"


def host_sync_check(fn: Callable[[], object], device: torch.device) -> str:
    """'none' if fn runs under torch.cuda.set_sync_debug_mode("error"), else what raised; CUDA only."""
    if device.type != "cuda":
        return "n/a"
    synchronize(device)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as exc:
        return "SYNC: " + str(exc).splitlines()[0][:80]
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    synchronize(device)
    return "none"


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Device memory fn allocates at its peak beyond what is already held (workspaces, temporaries);
    deterministic allocator accounting, CUDA only (None elsewhere)."""
    if device.type != "cuda":
        return None
    synchronize(device)
    held = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - held
