"""Memory probes of benchmarks/memory.py: allocator-level live bytes, and gradient bytes outside gradacc's buffers."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from gradacc_ext.benchmarking.memory import allocated_bytes


class LiveBytes:
    """Bytes allocated minus freed since start(), with the peak: the CUDA allocator, or on CPU the allocator's
    own events replayed in time order (gradacc_ext.benchmarking.memory.allocated_bytes)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> LiveBytes:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
            self.end = torch.cuda.memory_allocated() - self.base
            return
        self.prof.__exit__(*exc)
        self.peak, self.end = allocated_bytes(self.prof)


class OutsideBytes:
    """Most gradient bytes alive outside gradacc's flat buffers at any post-accumulate-grad hook, per micro-step.

    Deterministic accounting (live tensors, not the allocator): .grad tensors and gradacc's queued bucket.
    For the plain loop that is all of .grad; for gradacc the bucket (hooks path) or nothing (views attached).
    """

    def __init__(self, params: list[torch.nn.Parameter], acc: object) -> None:
        self.params, self.acc, self.micro = params, acc, 0
        self.most = [0] * 4

    def __enter__(self) -> OutsideBytes:
        self.handles = [p.register_post_accumulate_grad_hook(self._probe) for p in self.params]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()

    def _probe(self, _param: torch.Tensor) -> None:
        buffers = getattr(self.acc, "_buffers", None)
        inside = {f.untyped_storage().data_ptr() for f in getattr(buffers, "flats", {}).values()}
        held = [p.grad for p in self.params if p.grad is not None]
        held += list(getattr(getattr(self.acc, "_hooks", None), "_queue", {}).values())
        n = sum(g.numel() * g.element_size() for g in held if g.untyped_storage().data_ptr() not in inside)
        self.most[self.micro] = max(self.most[self.micro], n)
