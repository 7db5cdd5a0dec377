"""Memory probes of benchmarks/memory.py: allocator-level live bytes, and gradient bytes outside gradacc's buffers."""

from __future__ import annotations

import torch


class LiveBytes:
    """Bytes allocated minus freed since start(), with the peak: the CUDA allocator, or on CPU the profiler's
    allocation timeline (every allocation and free with its own timestamp).

    Per-op self memory summed by op start time is not enough on CPU: it puts a parent op's negative self memory
    (a temporary its child allocated) before the child's allocation and so under-reads peaks (AdamW(foreach)'s
    4 B/param sqrt temporaries read as 0.08 B/param that way).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> LiveBytes:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(
                activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
            )
            self.prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
            self.end = torch.cuda.memory_allocated() - self.base
            return
        from torch.profiler._memory_profiler import Action

        self.prof.__exit__(*exc)
        live = self.peak = 0
        for _, action, _, size in sorted(self.prof._memory_profile().timeline, key=lambda row: row[0]):
            live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
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
