"""GradientAccumulatorCallback where it meets Lightning's other parts: the DDP strategies (two gloo ranks),
strategies it refuses, a fit that raised, and Lightning's fp16 GradScaler (issue 27, findings 1, 7, 8)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

pl = pytest.importorskip("lightning.pytorch")

from _common import CLIP, assert_same_params, params_of  # noqa: E402
from _dist import launch, needs_gloo  # noqa: E402
from _lightning import AccumulatorRegressor, Regressor, loader, trainer  # noqa: E402

from gradacc_ext import GradientAccumulationConfig  # noqa: E402
from gradacc_ext.integrations.lightning import GradientAccumulatorCallback  # noqa: E402

pytestmark = pytest.mark.frameworks
WINDOW = 2


def _ddp_fits(rank: int, world: int) -> None:
    """One rank: Lightning's accumulate_grad_batches=2, then the callback with a window of 2, both under
    strategy="ddp" on the process group that launch() started (processes created externally, as torchrun
    does; Lightning then joins the group instead of launching). Each rank's weights must equal the reference
    and the other rank's."""
    os.environ["LOCAL_RANK"] = str(rank)
    ddp = {"strategy": "ddp", "devices": world}
    start = params_of(Regressor(fused=False))
    reference = Regressor(fused=False)
    trainer("32", accumulate_grad_batches=WINDOW, gradient_clip_val=CLIP, **ddp).fit(reference, loader())
    config = GradientAccumulationConfig(accumulation_steps=WINDOW, max_grad_norm=CLIP)
    module = AccumulatorRegressor(fused=False)
    trainer("32", callbacks=[GradientAccumulatorCallback(config)], **ddp).fit(module, loader())
    got = params_of(module)
    assert_same_params(got, params_of(reference), start)
    ranks: list[dict[str, torch.Tensor] | None] = [None] * world
    dist.all_gather_object(ranks, got)
    for name, value in got.items():
        torch.testing.assert_close(value, ranks[0][name], rtol=0, atol=0, msg=f"{name}: rank {rank} != rank 0")


@pytest.mark.distributed
@needs_gloo
def test_lightning_callback_under_ddp_equals_accumulate_grad_batches_on_every_rank() -> None:
    launch(_ddp_fits, 2, timeout=180)
