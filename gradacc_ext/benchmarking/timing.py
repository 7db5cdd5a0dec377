"""Timing, the bandwidth roofline, launch counting and host-sync checks.

Timing: torch.utils.benchmark.Timer.adaptive_autorange. It calibrates the calls
per block so the timer's own overhead is negligible (that is also the warm-up),
sets the torch thread count, synchronises CUDA, and stops once the blocks agree
(IQR / median below `threshold`) or the time budget is spent. A cell's
implementations take turns (measure_interleaved), so a load change on a shared
machine hits all of them alike. Every call runs on
the next of several input sets, enough of them that together they move more bytes
than the last-level cache holds, so no cell is timed from cache.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import statistics
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.utils.benchmark import Measurement, Timer

MAX_SETS = 256
CPU_CACHE_FALLBACK = 32 << 20
CACHE_MULTIPLE = 8  # benchmarks/compare.py's rotation: 8x the last-level cache (gradacc bench: 2x, see cli_config)


@dataclass(frozen=True)
class TimingConfig:
    threshold: float = 0.05  # stop once the blocks' IQR / median is below this ...
    min_time_s: float = 0.2  # ... and at least this long was timed
    max_time_s: float = 2.0  # stop here even if the spread stays above threshold (a busy machine)
    threads: int | None = None  # torch CPU threads while timing; None: torch's current setting
    rounds: int = 3  # turns per implementation in measure_interleaved; the times above are for all turns

    def __post_init__(self) -> None:
        bad_threads = self.threads is not None and self.threads < 1
        if not (0 < self.threshold and 0 <= self.min_time_s <= self.max_time_s) or bad_threads or self.rounds < 1:
            raise ValueError(
                f"invalid timing config {self}: need threshold > 0, 0 <= min_time_s <= max_time_s, threads >= 1, "
                "rounds >= 1"
            )


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


def rotation_bytes(device: torch.device, cache_multiple: int = CACHE_MULTIPLE) -> int:
    """Bytes the rotated input sets must move together, and the size of the roofline's streams.

    At least `cache_multiple` x the reported last-level cache, and a floor on top,
    because a virtual machine may report less cache than the host has (on a 2-core
    VM a 78 MB set that fit the real cache ran at 3x the copy bandwidth).
    """
    floor = 1 << 30 if device.type == "cuda" else 1 << 28
    return max(floor, cache_multiple * cache_bytes(device))


def sets_needed(bytes_per_set: int, device: torch.device, cache_multiple: int = CACHE_MULTIPLE) -> int:
    """Input sets to rotate so that together they move at least rotation_bytes (at most MAX_SETS)."""
    total = rotation_bytes(device, cache_multiple)
    return max(1, min(MAX_SETS, math.ceil(total / max(1, bytes_per_set))))


def rotating(fn: Callable[[object], object], inputs: Sequence[object]) -> Callable[[], object]:
    """fn on inputs[0], inputs[1], ... in turn, one per call."""
    counter = itertools.count()
    return lambda: fn(inputs[next(counter) % len(inputs)])


def measure(fn: Callable[[], object], cfg: TimingConfig) -> Measurement:
    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=cfg.threads or torch.get_num_threads())
    return timer.adaptive_autorange(cfg.threshold, min_run_time=cfg.min_time_s, max_run_time=cfg.max_time_s)


def measure_interleaved(fns: Mapping[str, Callable[[], object]], cfg: TimingConfig) -> dict[str, list[Measurement]]:
    """Times every fn in cfg.rounds turns, the order reversed every other round (a b c, c b a, a b c),
    each turn a measure() with 1/rounds of the time budget.

    Timed one after the other, the implementations of a cell met different loads on a shared machine
    (one cell's ratio ranged 0.19x-0.29x over two runs and 0.12x-2.8x in standalone timings); taking
    turns, a load change hits all of them alike.
    """
    turn = replace(cfg, min_time_s=cfg.min_time_s / cfg.rounds, max_time_s=cfg.max_time_s / cfg.rounds)
    names = list(fns)
    out: dict[str, list[Measurement]] = {name: [] for name in names}
    for r in range(cfg.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            out[name].append(measure(fns[name], turn))
    return out


def summarize(ms: Measurement | Sequence[Measurement]) -> dict[str, float]:
    """Seconds per call over every block of every turn: median and best block, the spread (IQR / median,
    quartiles interpolated as numpy does), how many blocks and the fewest calls per block."""
    ms = [ms] if isinstance(ms, Measurement) else list(ms)
    per_call = [t / m.number_per_run for m in ms for t in m.raw_times]
    q1, median, q3 = statistics.quantiles(per_call, n=4, method="inclusive") if len(per_call) > 1 else per_call * 3
    return {
        "median_s": median,
        "best_s": min(per_call),
        "spread": (q3 - q1) / median if median > 0 else math.inf,
        "blocks": len(per_call),
        "calls_per_block": min(m.number_per_run for m in ms),
    }


class Roofline:
    """The machine's streaming bandwidth, which no bandwidth-bound cell can beat.

    Two fp32 streams, src and dst together half as large as the bytes the rotated
    input sets move (a cell's sets occupy at least that: no byte is counted more
    than twice, read and written), so no cell runs more from cache than they do;
    each stream charged the bytes it reads and writes: dst.copy_(src) (8 B per element)
    and the in-place dst.add_(src) (12 B). The in-place one is needed because
    most cells update in place: on a CPU, copy_ also reads each dst line before
    writing it (write-allocate, uncounted), so an in-place update ran at 1.6x
    copy_'s counted bandwidth on this VM.

    A few calls of each stream are sampled at the start and after every cell,
    and the roofline is the fastest call of the run. On a shared machine the
    bandwidth a cell gets changes from one second to the next; a roofline taken
    only at the start let a cell timed in a quieter moment reach 4x it. Cells are
    charged at their median; one that still beats the roofline was timed in a
    quieter moment than every sample, and the report says so instead of a % > 100.

    The streams exist only during a sample (between cells): held for the whole
    run they sat beside every cell's input sets, hundreds of MiB of peak memory.
    """

    CALLS = 2  # per stream and sample: each call moves hundreds of MiB

    def __init__(self, device: torch.device, nbytes: int, threads: int | None = None) -> None:
        self.device = device
        self.numel = max(1, nbytes // 16)
        self.threads = threads or torch.get_num_threads()
        self.samples: list[dict[str, float]] = []

    def streams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh (src, dst). Constant fills: a stream's speed does not depend on its values, and
        drawing hundreds of MiB of random numbers took seconds of a `gradacc bench` run."""
        src = torch.full((self.numel,), 1.0, dtype=torch.float32, device=self.device)
        dst = torch.full((self.numel,), 0.5, dtype=torch.float32, device=self.device)
        return src, dst

    def sample(self) -> dict[str, float]:
        src, dst = self.streams()
        streams = {
            "copy_gbps": ("dst.copy_(src)", 8),
            # A tiny alpha keeps dst near its values over thousands of adds (no overflow, no subnormals).
            "inplace_gbps": ("dst.add_(src, alpha=1e-30)", 12),
        }
        sample = {}
        for key, (stmt, nbytes) in streams.items():
            timer = Timer(stmt, globals={"src": src, "dst": dst}, num_threads=self.threads)
            best = min(timer.timeit(1).raw_times[0] for _ in range(self.CALLS))
            sample[key] = nbytes * self.numel / best / 1e9
        self.samples.append(sample)
        return sample

    @property
    def gbps(self) -> float:
        return max(max(sample.values()) for sample in self.samples)

    def percent(self, gbps: float) -> float | None:
        """gbps as a % of the roofline; None above 100: that cell was timed in a quieter moment than
        every sample, so its figure measures the machine's load, not the op."""
        pct = 100.0 * gbps / self.gbps
        return pct if pct <= 100.0 else None


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Drops what C++ code prints to file descriptor 2 (the profiler's USDT start/stop lines).

    Python exceptions still propagate; only raw writes to fd 2 inside the block are lost.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def count_launches(fn: Callable[[], object], device: torch.device) -> tuple[int, str]:
    """Device operations (kernels, memcpy, memset) on CUDA; dispatched aten/gradacc ops on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with quiet_stderr(), profile(activities=activities) as prof:
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
