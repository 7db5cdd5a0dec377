"""The parameter sets the benchmarks run on: shapes only, no data.

Every set can be scaled for slow machines: `scale` multiplies every tensor
dimension (model width, MLP width, vocabulary, context length and the sizes
of the small tensors) and never changes the number of tensors, so per-tensor
costs (launches, dispatch, Python loops) stay those of the full-size model
while the element count shrinks (about scale**2 for the 2-D models).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

Shape = tuple[int, ...]

# One tensor of more than 2**31 elements (the int32-index overflow case,
# torch #169930). Odd on purpose so no vector width divides it. GPU only,
# never scaled: at another size it would no longer test what it is for.
HUGE_NUMEL = 2**31 + 4099
SMALL_COUNT = 2000
SMALL_MAX_NUMEL = 4096


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    shapes: tuple[Shape, ...]
    scale: float
    gpu_only: bool = False
    large: bool = False  # counts as a "large set" for the bandwidth target

    @property
    def num_tensors(self) -> int:
        return len(self.shapes)

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def summary(self) -> str:
        return f"{self.num_tensors} tensors, {self.numel:,} elements, scale {self.scale:g}"


def _dim(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def gpt_shapes(vocab: int, ctx: int, d_model: int, n_layer: int, scale: float = 1.0) -> tuple[Shape, ...]:
    """GPT-2 parameter shapes in Hugging Face order (Conv1D weights are [in, out])."""
    v, c, d = _dim(vocab, scale), _dim(ctx, scale), _dim(d_model, scale)
    shapes: list[Shape] = [(v, d), (c, d)]  # wte, wpe
    for _ in range(n_layer):
        shapes += [
            (d,), (d,),  # ln_1 weight, bias
            (d, 3 * d), (3 * d,),  # attn.c_attn
            (d, d), (d,),  # attn.c_proj
            (d,), (d,),  # ln_2
            (d, 4 * d), (4 * d,),  # mlp.c_fc
            (4 * d, d), (d,),  # mlp.c_proj
        ]  # fmt: skip
    shapes += [(d,), (d,)]  # ln_f
    return tuple(shapes)


def small_shapes(scale: float = 1.0) -> tuple[Shape, ...]:
    """2,000 1-D tensors of 1..4096 elements (fixed seed): biases and norms of a deep narrow net."""
    rng = random.Random(SMALL_COUNT)
    return tuple((_dim(rng.randint(1, SMALL_MAX_NUMEL), scale),) for _ in range(SMALL_COUNT))


def gpt2_small(scale: float = 1.0) -> Workload:
    return Workload(
        "gpt2-small",
        "GPT-2 small (124M): wte 50257x768, wpe 1024x768, 12 layers, final ln",
        gpt_shapes(50257, 1024, 768, 12, scale),
        scale,
        large=True,
    )


def gpt_1_3b(scale: float = 1.0) -> Workload:
    return Workload(
        "gpt-1.3b",
        "GPT-3 XL-like (1.3B): wte 50257x2048, wpe 2048x2048, 24 layers, final ln",
        gpt_shapes(50257, 2048, 2048, 24, scale),
        scale,
        large=True,
    )


def small_2000(scale: float = 1.0) -> Workload:
    return Workload("small-2000", "2,000 small 1-D tensors of 1..4096 elements", small_shapes(scale), scale)


def huge(scale: float = 1.0) -> Workload:
    if scale != 1.0:
        raise ValueError(f"workload 'huge' cannot be scaled (it must exceed 2**31 elements), got scale {scale}")
    return Workload("huge", "one tensor of 2**31 + 4099 elements", ((HUGE_NUMEL,),), 1.0, gpu_only=True, large=True)


WORKLOADS = {"gpt2-small": gpt2_small, "gpt-1.3b": gpt_1_3b, "small-2000": small_2000, "huge": huge}


def make_workload(name: str, scale: float = 1.0) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; expected one of {sorted(WORKLOADS)}")
    if not (math.isfinite(scale) and 0 < scale <= 1):
        raise ValueError(f"scale of workload {name!r} must be in (0, 1], got {scale}")
    return WORKLOADS[name](scale)


def parse_workloads(spec: str, default_scale: float = 1.0) -> list[Workload]:
    """'gpt2-small,gpt-1.3b=0.5' -> workloads; a name without '=scale' gets default_scale."""
    out = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, scale = item.partition("=")
        try:
            value = float(scale) if scale else default_scale
        except ValueError:
            raise ValueError(f"workload spec {item!r}: scale must be a number, got {scale!r}") from None
        out.append(make_workload(name, 1.0 if name == "huge" and not scale else value))
    if not out:
        raise ValueError(f"workload spec {spec!r} names no workload")
    return out
