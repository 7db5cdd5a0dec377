"""DDP "buffer": one rank's OOM in a later micro-batch's backward is rolled back by running its window again on that
rank alone (nothing is reduced before the window's end); every rank ends equal to the full batch (issue 27, finding 3).

Real gloo processes; the reference is the plain single-process loop over each window's whole batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _cases import OOMInBackward
from _dist import STEPS, assert_params_equal, global_batches, launch, make_model, make_optimizer, needs_gloo, reference
from _dist import shard as shard_of

from gradacc_ext import AdaptiveGradientAccumulator, GradientAccumulationConfig

pytestmark = [pytest.mark.distributed, needs_gloo]
SEED = 23


def worker(rank: int, world: int) -> None:
    ddp = torch.nn.parallel.DistributedDataParallel(make_model())
    opt = make_optimizer(ddp.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    config = GradientAccumulationConfig(accumulation_steps=STEPS, max_grad_norm=0.5, ddp_reduce="buffer")
    acc = AdaptiveGradientAccumulator(ddp, opt, config, sched)
    calls = [0]

    def between_layers(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        # Rank 1, the window's second micro-batch: its backward fails after the last Linear's gradients were
        # added to the first micro-batch's sums.
        return OOMInBackward.apply(out) if rank == 1 and calls[0] == 2 else out

    ddp.module[1].register_forward_hook(between_layers)

    def loss_fn(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        calls[0] += 1
        x, y = batch
        return F.mse_loss(model(x), y)

    for batch in global_batches("mean", world, SEED):
        acc.step_batch(shard_of(batch, rank), loss_fn)
    acc.flush()
    assert_params_equal(ddp.module, reference("mean", world, SEED))
    history = acc.get_adaptation_stats()["adaptation_history"]
    assert history == ([{"window": 0, "from": 2, "to": 1, "replayed": 1}] if rank == 1 else [])


def test_one_rank_replays_its_window_alone_and_every_rank_equals_the_full_batch():
    launch(worker, 2)
