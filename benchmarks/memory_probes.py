"""Memory probes of benchmarks/memory.py: allocator-level live bytes, and gradient bytes outside gradacc's buffers."""

from __future__ import annotations

import torch


class LiveBytes:
    """Bytes allocated minus freed since start(), with the peak: allocator events on CPU, the CUDA allocator."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> LiveBytes:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            from torch.profiler import ProfilerActivity, profile

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
        events = [e for e in self.prof.events() if e.name == "[memory]" or e.self_cpu_memory_usage]
        events.sort(key=lambda e: e.time_range.start)
        live = self.peak = 0
        for e in events:
            live += e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
            self.peak = max(self.peak, live)
        self.end = live


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
