"""Resume is exact in every mode: optimizer kind x scheduler x AMP mode x where the run is cut.

The checkpoint is taken the usual way, scheduler state first and the
accumulator's last, which is where a deferred (fused-optimizer) scheduler
decision used to be resolved after the scheduler had been captured.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _cases import make_batches, make_model

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


@pytest.mark.parametrize("amp", ["no", "bf16", "fp16"])
@pytest.mark.parametrize("sched_kind", list(SCHEDULERS))
@pytest.mark.parametrize("opt_kind", list(OPTIMIZERS))
def test_resume_equals_uninterrupted(opt_kind, sched_kind, amp, tmp_path):
    seed = 7
    batches = make_batches(BATCHES, 4, torch.float32, seed)
    model, _, sched, acc = build(opt_kind, sched_kind, amp, seed)
    feed(acc, model, batches)
    acc.flush()
    for cut in (4, 6):  # mid-window (one micro-step into the second window), and at a window boundary
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
        # The resumed run, and the run that saved (saving changes no state), both end where the uninterrupted one does.
        for run_model, run_acc, run_sched in ((model2, acc2, sched2), (model1, acc1, sched1)):
            feed(run_acc, run_model, batches[cut:])
            run_acc.flush()
            for p, q in zip(run_model.parameters(), model.parameters(), strict=True):
                torch.testing.assert_close(p, q, rtol=0, atol=0, msg=lambda m, cut=cut: f"cut at {cut}: {m}")
            assert run_sched.get_last_lr() == sched.get_last_lr()
            assert (run_acc.optimizer_steps, run_acc.skipped_steps) == (acc.optimizer_steps, acc.skipped_steps)
        assert acc.optimizer_steps + acc.skipped_steps == 3


def test_replicated_state_only_at_a_window_boundary():
    """state_dict(replicated=True) (one state for every rank: Lightning under DDP) refuses an open window and
    changes nothing; at a boundary it resumes exactly, the same as the per-process state."""
    batches = make_batches(2 * N, 4, torch.float32, 3)
    model, opt, sched, acc = build("fused", "lambda", "fp16", 0)
    feed(acc, model, batches[: N + 1])  # one window closed, one micro-step into the next
    before = acc.state_dict()
    with pytest.raises(RuntimeError, match=r"replicated=True.*1 micro-step\(s\).*window boundary"):
        acc.state_dict(replicated=True)
    assert acc.micro_steps_in_window == 1
    torch.testing.assert_close(acc.state_dict()["buffers"], before["buffers"], rtol=0, atol=0)
    feed(acc, model, batches[N + 1 : 2 * N])  # closes the second window
    # the accumulator's last, as a checkpoint takes them; copies, as a file would be (state_dict() returns references)
    saved = copy.deepcopy([m.state_dict() for m in (model, opt, sched)])
    state = acc.state_dict(replicated=True)
    assert state["replicated"] and state["micro"] == 0
    model2, opt2, sched2, acc2 = build("fused", "lambda", "fp16", 0)
    for m, s in zip((model2, opt2, sched2), saved, strict=True):
        m.load_state_dict(s)
    acc2.load_state_dict(state)
    more = make_batches(N, 4, torch.float32, 4)
    feed(acc, model, more)
    feed(acc2, model2, more)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert (acc2.optimizer_steps, acc2.skipped_steps) == (acc.optimizer_steps, acc.skipped_steps)
