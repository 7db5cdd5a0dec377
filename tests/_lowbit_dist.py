"""What the low-bit-state FSDP2 tests share: a model whose params on 2 ranks are block-aligned or not, the same
batches on every rank (FSDP2's average of equal float32 grads over 2 or 4 ranks is exact, so each rank's grads are
one process's), the fused optimizers with a state_dtype, and bit-for-bit comparisons of params and states.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from gradacc_ext import GradientAccumulationConfig, GradientAccumulator
from gradacc_ext.optim import FusedAdamW, FusedLion, FusedSGD

IN, OUT, ROWS = 384, 1, 8
# On 2 ranks (torch.chunk along dim 0): 0.weight [3, 384] holds rows 2 | 1 = blocks 3 | 2 (a partial last block),
# 2.weight [512, 3] and 2.bias [512] whole blocks on each rank, 8.weight [1, 256] and 8.bias [1] all on rank 0
# (rank 1's shards empty): aligned. 4.weight [3, 512] holds whole blocks 4 | 2, but a DTensor of its 6 scales
# splits 3 | 3; 6.weight [256, 3] and 6.bias [256] split at elements 384 and 128, the small biases inside their
# one block: these keep fp32 states.
ALIGNED_ON_2 = ("0.weight", "2.weight", "2.bias", "8.weight", "8.bias")


def mixed_model(seed: int = 3) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    sizes = [(IN, 3), (3, 512), (512, 3), (3, 256), (256, OUT)]
    layers: list[torch.nn.Module] = []
    for fan_in, fan_out in sizes:
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def aligned_model(seed: int = 3) -> torch.nn.Sequential:
    """Every param aligned on 1, 2 and 4 ranks: dim 0 splits evenly, each shard whole blocks."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, 8, bias=False), torch.nn.Tanh(), torch.nn.Linear(8, 1024))


def sharded(model: torch.nn.Module, mesh, dim1: tuple[int, ...] = ()) -> torch.nn.Module:
    """fully_shard every Linear, then the model; the weights of the layers at `dim1` shard along dim 1."""
    for index, module in enumerate(model):
        if isinstance(module, torch.nn.Linear):
            along = (lambda p: Shard(1) if p.ndim == 2 else None) if index in dim1 else None
            fully_shard(module, mesh=mesh, shard_placement_fn=along)
    fully_shard(model, mesh=mesh)
    return model


def batches(count: int, seed: int, out: int = OUT) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(ROWS, IN, generator=g), torch.randn(ROWS, out, generator=g)) for _ in range(count)]


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, data: list) -> None:
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def train_accumulated(model: torch.nn.Module, opt: torch.optim.Optimizer, data: list) -> GradientAccumulator:
    """Windows of 2 micro-batches through GradientAccumulator, each window ending in its fused tail."""
    acc = GradientAccumulator(model, opt, GradientAccumulationConfig(accumulation_steps=2, fused_step=True))
    for x, y in data:
        with acc.micro_step():
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
    return acc


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": lambda params, **kw: FusedAdamW(params, lr=1e-2, weight_decay=0.1, **kw),
    "lion": lambda params, **kw: FusedLion(params, lr=1e-3, weight_decay=0.1, **kw),
    "sgd": lambda params, **kw: FusedSGD(params, lr=1e-2, momentum=0.9, **kw),
}


def make_opt(name: str, params, state_dtype: str = "int8", **kw) -> torch.optim.Optimizer:
    return OPTIMIZERS[name](params, state_dtype=state_dtype, int8_min_numel=0, seed=7, **kw)


def split_groups(model: torch.nn.Module, aligned: tuple[str, ...]) -> list[dict]:
    """One process's param groups that store as the sharded run does: `aligned` int8, the others fp32."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n in aligned]},
        {"params": [p for n, p in named if n not in aligned], "state_dtype": "fp32"},
    ]


def full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def assert_same_run(model, opt, ref, ref_opt) -> None:
    """Params and every state entry (codes, scales, maps, fp32 states, steps) equal bit for bit (either run
    sharded or not)."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(full(p.detach()), full(q.detach())), name
        mine, theirs = opt.state[p], ref_opt.state[q]
        assert mine.keys() == theirs.keys(), (name, sorted(mine), sorted(theirs))
        for key, value in mine.items():
            if isinstance(value, torch.Tensor):
                a, b = full(value), full(theirs[key])
                assert a.dtype == b.dtype and torch.equal(a, b), (name, key)
            else:
                assert value == theirs[key], (name, key)


def dcp_save(model, opt, ckpt: str) -> None:
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)


def dcp_load(model, opt, ckpt: str) -> None:
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
