"""Gradient accumulation with gradacc_ext under DDP, FSDP2 (fully_shard) or HSDP, on CPU with gloo.

    torchrun --nproc-per-node 2 examples/distributed_accumulate.py --mode fsdp
    torchrun --nproc-per-node 2 examples/distributed_accumulate.py --mode ddp --ddp-reduce overlap
    torchrun --nproc-per-node 4 examples/distributed_accumulate.py --mode hsdp
    python -m torch.distributed.run --nproc-per-node 2 examples/distributed_accumulate.py --checkpoint /tmp/ckpt

Every rank trains on its own token batches of uneven length (loss_normalization="sum":
the window's gradient is the mean over all tokens of all ranks), clips the global norm,
and closes the last, short window with micro_step(last=True). With --checkpoint, it
saves a sharded checkpoint (torch.distributed.checkpoint) in the middle of a window,
then loads it into fresh objects and finishes from there (DDP, or FSDP2 with
--fsdp-reduce micro_step: HSDP and "window" cannot checkpoint mid-window).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from gradacc_ext import GradientAccumulationConfig, GradientAccumulator

WIDTH, STEPS, BATCHES = 32, 4, 14


def build(args: argparse.Namespace, world: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 64), torch.nn.GELU(), torch.nn.Linear(64, WIDTH))
    if args.mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        if args.mode == "fsdp":
            mesh = init_device_mesh("cpu", (world,))
        else:  # HSDP: replicate x shard
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for module in (model[0], model[2], model):
            fully_shard(module, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config = GradientAccumulationConfig(
        accumulation_steps=STEPS,
        max_grad_norm=1.0,
        loss_normalization="sum",
        ddp_reduce=args.ddp_reduce,
        fsdp_reduce=args.fsdp_reduce,
    )
    return model, optimizer, GradientAccumulator(model, optimizer, config)


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Padded sequences with random lengths: every rank sees a different token count."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(BATCHES):
        lengths = torch.randint(1, 9, (4,), generator=g)
        mask = (torch.arange(8)[None, :] < lengths[:, None]).float()
        x = torch.randn(4, 8, WIDTH, generator=g)
        out.append((x, x.roll(1, dims=-1), mask))
    return out


def train(model, acc, data, start: int, stop: int) -> None:
    for i in range(start, stop):
        x, y, mask = data[i]
        with acc.micro_step(last=i == BATCHES - 1):
            loss = (((model(x) - y) ** 2).mean(-1) * mask).sum()
            if acc.backward(loss, num_items=int(mask.sum())) and dist.get_rank() == 0:
                print(f"step {acc.optimizer_steps}: grad norm {acc.grad_norm_history()[-1]:.4f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("ddp", "fsdp", "hsdp"), default="fsdp")
    parser.add_argument("--ddp-reduce", choices=("buffer", "overlap"), default="buffer")
    parser.add_argument("--fsdp-reduce", choices=("micro_step", "window"), default="micro_step")
    parser.add_argument("--checkpoint", help="a directory: save mid-window there, resume from it")
    args = parser.parse_args()
    if args.checkpoint and (args.mode == "hsdp" or (args.mode == "fsdp" and args.fsdp_reduce == "window")):
        parser.error(
            "--checkpoint saves in the middle of a window, where HSDP and --fsdp-reduce window still hold FSDP's "
            "partly reduced sums: use it with --mode ddp, or --mode fsdp --fsdp-reduce micro_step"
        )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer, acc = build(args, world)
    data = batches(rank)
    cut = BATCHES // 2 if args.checkpoint else BATCHES  # mid-window: 7 = one window of 4 and 3 micro-steps
    train(model, acc, data, 0, cut)
    if args.checkpoint:
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd, "acc": acc.state_dict()}, checkpoint_id=args.checkpoint)
        model, optimizer, acc = build(args, world)  # fresh objects, as after a restart
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd, "acc": acc.state_dict()}
        dcp.load(state, checkpoint_id=args.checkpoint)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        acc.load_state_dict(state["acc"])
        if rank == 0:
            print(f"resumed {acc.micro_steps_in_window} micro-steps into a window", flush=True)
        train(model, acc, data, cut, BATCHES)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    main()
