"""GradientAccumulatorCallback where it meets Lightning's other parts: the DDP strategies (two gloo ranks),
strategies it refuses, a fit that raised, and Lightning's fp16 GradScaler (issue 27, findings 1, 7, 8)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

pl = pytest.importorskip("lightning.pytorch")

from _common import ACCUM, CLIP, assert_same_params, params_of  # noqa: E402
from _dist import launch, needs_gloo  # noqa: E402
from _lightning import BATCHES, AccumulatorRegressor, Regressor, fit, loader, trainer  # noqa: E402

from gradacc_ext import GradientAccumulationConfig  # noqa: E402
from gradacc_ext.integrations.lightning import GradientAccumulatorCallback  # noqa: E402

pytestmark = pytest.mark.frameworks
WINDOW = 2


def _ddp_fits(rank: int, world: int) -> None:
    """One rank: Lightning's accumulate_grad_batches=2, then the callback with a window of 2 (torch's AdamW, then
    FusedAdamW), all under strategy="ddp" on the process group that launch() started (processes created
    externally, as torchrun does; Lightning then joins the group instead of launching). Each rank's weights must
    equal the reference and the other rank's."""
    os.environ["LOCAL_RANK"] = str(rank)
    ddp = {"strategy": "ddp", "devices": world}
    start = params_of(Regressor(fused=False))
    reference = Regressor(fused=False)
    trainer("32", accumulate_grad_batches=WINDOW, gradient_clip_val=CLIP, **ddp).fit(reference, loader())
    for fused in (False, True):
        config = GradientAccumulationConfig(accumulation_steps=WINDOW, max_grad_norm=CLIP)
        module, callback = AccumulatorRegressor(fused), GradientAccumulatorCallback(config)
        t = trainer("32", callbacks=[callback], **ddp)
        t.fit(module, loader())
        got = params_of(module)
        assert_same_params(got, params_of(reference), start)
        ranks: list[dict[str, torch.Tensor] | None] = [None] * world
        dist.all_gather_object(ranks, got)
        for name, value in got.items():
            torch.testing.assert_close(value, ranks[0][name], rtol=0, atol=0, msg=f"{name}: rank {rank} != rank 0")
        windows = BATCHES // world // WINDOW  # the DistributedSampler gives each rank half of the batches
        assert t.global_step == windows and callback.accumulator.optimizer_steps == windows


@pytest.mark.distributed
@needs_gloo
def test_lightning_callback_under_ddp_equals_accumulate_grad_batches_on_every_rank() -> None:
    launch(_ddp_fits, 2, timeout=180)


def _ddp_resume(rank: int, world: int, ckpt: str) -> None:
    """Under strategy="ddp": two epochs at once equal one epoch, Lightning's checkpoint (rank 0's file), and a
    resumed second epoch, on every rank; a checkpoint in the middle of a window is refused with a clear error."""
    os.environ["LOCAL_RANK"] = str(rank)
    ddp = {"strategy": "ddp", "devices": world}

    def run(max_epochs: int, ckpt_path=None) -> tuple[AccumulatorRegressor, pl.Trainer, GradientAccumulatorCallback]:
        config = GradientAccumulationConfig(accumulation_steps=WINDOW, max_grad_norm=CLIP)
        module, callback = AccumulatorRegressor(fused=True), GradientAccumulatorCallback(config)
        t = trainer("32", max_epochs=max_epochs, callbacks=[callback], **ddp)
        t.fit(module, loader(), ckpt_path=ckpt_path)
        return module, t, callback

    start = params_of(Regressor(fused=False))
    whole, _, _ = run(2)
    first, t, callback = run(1)
    t.save_checkpoint(ckpt)  # Lightning writes rank 0's state; every rank loads that file
    resumed, t, _ = run(2, ckpt_path=ckpt)
    assert_same_params(params_of(resumed), params_of(whole), start)
    windows = 2 * (BATCHES // world // WINDOW)
    assert t.global_step == windows and resumed.accumulator.optimizer_steps == windows
    acc = callback.accumulator  # closed by fit's end, its window empty: reopen one micro-step by hand
    acc._window.micro = 1
    with pytest.raises(RuntimeError, match=r"Lightning saves rank 0's checkpoint alone.*window boundary"):
        callback.state_dict()
    dist.barrier()


@pytest.mark.distributed
@needs_gloo
def test_lightning_callback_resumes_a_ddp_checkpoint_on_every_rank(tmp_path) -> None:
    launch(_ddp_resume, 2, str(tmp_path / "ddp.ckpt"), timeout=180)


class ShardedRegressor(AccumulatorRegressor):
    """FSDP2 through Lightning's ModelParallelStrategy (configure_model shards over its data-parallel mesh)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])


def _refused_strategies(rank: int, world: int) -> None:
    """Every rank raises at fit start, before the accumulator exists (none is left waiting in a collective)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    callback = GradientAccumulatorCallback(GradientAccumulationConfig(accumulation_steps=WINDOW))
    with pytest.raises(ValueError, match="this Trainer runs ModelParallelStrategy"):
        trainer(
            "32",
            strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
            devices=world,
            callbacks=[callback],
        ).fit(ShardedRegressor(fused=False), loader())
    overlap = GradientAccumulatorCallback(GradientAccumulationConfig(accumulation_steps=WINDOW, ddp_reduce="overlap"))
    with pytest.raises(ValueError, match="ddp_reduce='overlap'.*use ddp_reduce='buffer'"):
        trainer("32", strategy="ddp", devices=world, callbacks=[overlap]).fit(AccumulatorRegressor(False), loader())
    assert callback.accumulator is None and overlap.accumulator is None


@pytest.mark.distributed
@needs_gloo
def test_lightning_callback_refuses_model_parallel_and_ddp_overlap_at_fit_start() -> None:
    launch(_refused_strategies, 2, timeout=180)


@pytest.mark.parametrize("strategy", ["FSDPStrategy", "ModelParallelStrategy", "a DDPStrategy subclass"])
def test_lightning_callback_names_a_strategy_it_does_not_support(strategy: str) -> None:
    """Constructed only (no process group): DeepSpeedStrategy and XLAStrategy, absent here, subclass DDPStrategy."""
    from types import SimpleNamespace

    from lightning.pytorch import strategies

    from gradacc_ext.integrations.lightning_setup import accumulated_model

    made = (
        type("DeepSpeedLike", (strategies.DDPStrategy,), {})() if " " in strategy else getattr(strategies, strategy)()
    )
    config, name = GradientAccumulationConfig(accumulation_steps=WINDOW), type(made).__name__
    with pytest.raises(ValueError, match=f"this Trainer runs {name}, whose sharded"):
        accumulated_model(SimpleNamespace(strategy=made), AccumulatorRegressor(False), config)


class FailsOnce(AccumulatorRegressor):
    """Raises inside the first fit's third micro-step, after its forward, before any window closed."""

    failed = False

    def training_step(self, batch, batch_idx):
        if batch_idx == 2 and not self.failed:
            with self.accumulator.micro_step():
                self(batch[0])
                self.failed = True
                raise RuntimeError("training_step failed")
        return super().training_step(batch, batch_idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_lightning_callback_fits_again_after_a_fit_that_raised() -> None:
    """on_fit_end does not run after an exception; on_exception closes the accumulator, so the same callback
    fits the same module again, and that fit equals Lightning's accumulate_grad_batches from the same start."""
    start = params_of(Regressor(fused=False))
    want = fit(Regressor(fused=False), "32", accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP)
    callback = GradientAccumulatorCallback(GradientAccumulationConfig(accumulation_steps=ACCUM, max_grad_norm=CLIP))
    module = FailsOnce(fused=False)
    with pytest.raises(RuntimeError, match="training_step failed"):
        trainer("32", callbacks=[callback]).fit(module, loader())
    for name, value in params_of(module).items():  # no window closed: the weights are the start's
        assert torch.equal(value, start[name]), name
    trainer("32", callbacks=[callback]).fit(module, loader())
    assert_same_params(params_of(module), want, start)


def fp16_plugin() -> list:
    """Lightning's "16-mixed" on CPU (precision="16-mixed" itself turns into bf16-mixed there)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    return [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))]


def test_lightning_callback_scales_with_lightnings_fp16_grad_scaler() -> None:
    """A loss of 2**-20: unscaled, its fp16 gradients are subnormals and lose most of their bits. The callback
    scales with Lightning's GradScaler and updates it once per window, as accumulate_grad_batches does."""
    tiny = 2.0**-20
    start = params_of(Regressor(fused=False))
    want_plugin, got_plugin = fp16_plugin(), fp16_plugin()
    ref = dict(plugins=want_plugin, accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP)
    want = fit(Regressor(fused=False, loss_factor=tiny), None, **ref)
    callback = GradientAccumulatorCallback(GradientAccumulationConfig(accumulation_steps=ACCUM, max_grad_norm=CLIP))
    got = fit(AccumulatorRegressor(fused=False, loss_factor=tiny), None, plugins=got_plugin, callbacks=[callback])
    assert_same_params(got, want, start)
    for plugin in (want_plugin, got_plugin):  # three windows, no overflow: three unskipped updates
        assert plugin[0].scaler.state_dict()["_growth_tracker"] == 3 and plugin[0].scaler.get_scale() == 2.0**16


def test_lightning_callback_refuses_a_second_autocast_dtype() -> None:
    config = GradientAccumulationConfig(accumulation_steps=ACCUM, mixed_precision="bf16")
    with pytest.raises(ValueError, match="autocasts to fp16, but GradientAccumulationConfig.mixed_precision='bf16'"):
        fit(
            AccumulatorRegressor(fused=False),
            None,
            plugins=fp16_plugin(),
            callbacks=[GradientAccumulatorCallback(config)],
        )


def test_lightning_callback_drops_a_restored_state_that_a_failed_fit_never_loaded(tmp_path) -> None:
    """A fit from a checkpoint that fails before on_fit_start (here: refused, automatic optimisation) must not hand
    that checkpoint's accumulator state to the next fit, which starts from scratch."""
    config = GradientAccumulationConfig(accumulation_steps=ACCUM, max_grad_norm=CLIP)
    saved = trainer("32", callbacks=[GradientAccumulatorCallback(config)])
    saved.fit(AccumulatorRegressor(fused=False), loader())
    saved.save_checkpoint(tmp_path / "done.ckpt")
    callback = GradientAccumulatorCallback(config)
    with pytest.raises(ValueError, match="automatic_optimization = False"):
        trainer("32", callbacks=[callback]).fit(Regressor(fused=False), loader(), ckpt_path=tmp_path / "done.ckpt")
    start = params_of(Regressor(fused=False))
    want = fit(Regressor(fused=False), "32", accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP)
    got = fit(AccumulatorRegressor(fused=False), "32", callbacks=[callback])
    assert_same_params(got, want, start)
    assert callback.accumulator.optimizer_steps == BATCHES // ACCUM
