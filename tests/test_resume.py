"""Resume is exact in every mode: optimizer kind x scheduler x AMP mode x where the run is cut.

The checkpoint is taken the usual way, scheduler state first and the
accumulator's last, which is where a deferred (fused-optimizer) scheduler
decision used to be resolved after the scheduler had been captured.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_accumulator import make_batches, make_model

from gradacc_ext.accumulate.accumulator import GradientAccumulator
from gradacc_ext.accumulate.config import GradientAccumulationConfig

N, BATCHES = 3, 8
SCHEDULERS = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4),
}
OPTIMIZERS = {"plain": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def build(opt_kind: str, sched_kind: str, amp: str, seed: int):
    model = make_model(torch.float32, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, eps=1e-3, **OPTIMIZERS[opt_kind])
    sched = SCHEDULERS[sched_kind](opt)
    config = GradientAccumulationConfig(accumulation_steps=N, mixed_precision=amp, max_grad_norm=0.5)
    return model, opt, sched, GradientAccumulator(model, opt, config, sched)


def feed(acc: GradientAccumulator, model: torch.nn.Module, batches) -> None:
    for x, y in batches:
        with acc.micro_step():
            acc.backward(F.mse_loss(model(x).float(), y))


@pytest.mark.parametrize("cut", [4, 6], ids=["mid-window", "window-boundary"])
@pytest.mark.parametrize("amp", ["no", "bf16", "fp16"])
@pytest.mark.parametrize("sched_kind", list(SCHEDULERS))
@pytest.mark.parametrize("opt_kind", list(OPTIMIZERS))
def test_resume_equals_uninterrupted(opt_kind, sched_kind, amp, cut, tmp_path):
    seed = 7
    batches = make_batches(BATCHES, 4, torch.float32, seed)
    model, _, sched, acc = build(opt_kind, sched_kind, amp, seed)
    feed(acc, model, batches)
    acc.flush()

    model1, opt1, sched1, acc1 = build(opt_kind, sched_kind, amp, seed)
    feed(acc1, model1, batches[:cut])
    state = {
        "model": model1.state_dict(),
        "opt": opt1.state_dict(),
        "sched": sched1.state_dict(),  # captured before the accumulator's state, as a training script does
        "acc": acc1.state_dict(),
    }
    torch.save(state, tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    model2, opt2, sched2, acc2 = build(opt_kind, sched_kind, amp, seed)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    sched2.load_state_dict(state["sched"])
    acc2.load_state_dict(state["acc"])
    feed(acc2, model2, batches[cut:])
    acc2.flush()

    for p, q in zip(model2.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert sched2.get_last_lr() == sched.get_last_lr()
    assert (acc2.optimizer_steps, acc2.skipped_steps) == (acc.optimizer_steps, acc.skipped_steps)
    assert acc2.optimizer_steps + acc2.skipped_steps == 3
    # The run that saved goes on as if nothing happened: saving changes no state.
    feed(acc1, model1, batches[cut:])
    acc1.flush()
    for p, q in zip(model1.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert sched1.get_last_lr() == sched.get_last_lr()
