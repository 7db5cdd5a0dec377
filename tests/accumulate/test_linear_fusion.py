"""gradient_accumulation_fusion (accumulate/linear_fusion.py): nn.Linear gradients written straight into the buffers.

The fused window gradient must equal the hooks path and the plain full-batch loop (float64: 1e-10, float32:
GEMM reassociation) in every normalisation mode, with clipping, fp16 loss scaling and an injected
overflow, a short last window, mid-window resume, a failed backward, tied weights in both arrival orders,
activation checkpointing and DDP (no_sync + the whole-buffer all-reduce); on CUDA, gradacc::wgrad_addmm_
and a bf16-param window with fp32 buffers. Inputs are [batch, seq, features]
with odd sizes so the 2-D reshapes are exercised. The hook-in itself: test_linear_fusion_hookin.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _dist import STEPS, TOL64, assert_params_equal, global_batches, launch, loss_and_items, needs_gloo, shard
from _dist import make_model as dist_model
from _dist import make_optimizer as dist_optimizer
from _dist import reference as dist_reference
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradacc_ext.accumulate.accumulator import GradientAccumulator
from gradacc_ext.accumulate.config import GradientAccumulationConfig
from gradacc_ext.ops import wgrad

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-6)}
IN, HIDDEN, OUT, SEQ = 5, 7, 3, 3
FUSION = dict(gradient_accumulation_fusion=True)


def make_model(dtype: torch.dtype, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)).to(dtype)


def make_batches(n: int, dtype: torch.dtype, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 5, (n,), generator=g).tolist()  # uneven micro-batches: num_items matters
    return [
        (torch.randn(b, SEQ, IN, generator=g, dtype=dtype), torch.randn(b, SEQ, OUT, generator=g, dtype=dtype))
        for b in sizes
    ]


def micro_loss(model: nn.Module, batch, mode: str, n: int) -> tuple[torch.Tensor, int | None]:
    x, y = batch
    if mode == "sum":
        return F.mse_loss(model(x), y, reduction="sum"), y.numel()
    loss = F.mse_loss(model(x), y)
    if mode == "none":
        return loss / n, None
    return loss, (y.numel() if mode == "mean_items" else None)


def window_loss(model: nn.Module, window, mode: str, n: int) -> torch.Tensor:
    """The plain full-batch loop's loss for one window (a short last window is normalised by its real size)."""
    if mode in ("sum", "mean_items"):
        return sum(F.mse_loss(model(x), y, reduction="sum") for x, y in window) / sum(y.numel() for _, y in window)
    if mode == "none":
        return sum(F.mse_loss(model(x), y) for x, y in window) / n
    return sum(F.mse_loss(model(x), y) for x, y in window) / len(window)


def plain_loop(model: nn.Module, batches, n: int, mode: str, max_norm=None, norm_type=2.0, clip_value=None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for start in range(0, len(batches), n):
        opt.zero_grad(set_to_none=True)
        window_loss(model, batches[start : start + n], mode, n).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        opt.step()


def accumulate(model: nn.Module, batches, n: int, mode: str, **config) -> GradientAccumulator:
    normalization = "mean" if mode == "mean_items" else mode
    cfg = GradientAccumulationConfig(accumulation_steps=n, loss_normalization=normalization, **config)
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), cfg)
    for batch in batches:
        with acc.micro_step():
            loss, items = micro_loss(model, batch, mode, n)
            acc.backward(loss, num_items=items)
    acc.flush()
    return acc


def assert_params_close(a: nn.Module, b: nn.Module, dtype: torch.dtype) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOL[dtype], msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", ["mean", "mean_items", "sum", "none"])
@pytest.mark.parametrize("clip", [None, (0.3, 2.0, None), (0.05, math.inf, 0.01)])
def test_fused_equals_hooks_path_and_full_batch(dtype, mode, clip):
    n, seed = 3, 11
    batches = make_batches(7, dtype, seed)  # 3 + 3 + 1: the last window is short
    max_norm, norm_type, clip_value = clip or (None, 2.0, None)
    config = dict(max_grad_norm=max_norm, norm_type=norm_type, clip_value=clip_value)
    fused, hooks, ref = make_model(dtype, seed), make_model(dtype, seed), make_model(dtype, seed)
    acc = accumulate(fused, batches, n, mode, **config, **FUSION)
    assert acc.stats.fused_linear_params == 4 and acc.stats.linear_fusion_fallbacks == {}
    accumulate(hooks, batches, n, mode, **config)
    plain_loop(ref, batches, n, mode, max_norm, norm_type, clip_value)
    assert_params_close(fused, ref, dtype)
    assert_params_close(fused, hooks, dtype)
    assert acc.optimizer_steps == 3


def test_weight_grad_never_reaches_autograd_and_buffers_are_assigned_not_zeroed():
    """The fused Linears give autograd no weight gradient; the window's first write assigns (beta=0) over NaN."""
    model = make_model(torch.float64, 3)
    cfg = GradientAccumulationConfig(accumulation_steps=2, **FUSION)
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    acc._buffers._ensure()
    for flat in acc._buffers.flats.values():
        flat.fill_(float("nan"))  # poisoned: a beta=1 first write (or a missed view) would show NaN
    seen_grads = []
    for p in model.parameters():
        p.register_hook(lambda g: seen_grads.append(g))
    x, y = make_batches(1, torch.float64, 3)[0]
    with acc.micro_step():
        acc.backward(F.mse_loss(model(x), y))
    assert len(seen_grads) == 4 and all(g is None for g in seen_grads)  # autograd sees an undefined gradient
    ref = make_model(torch.float64, 3)
    F.mse_loss(ref(x), y).backward()
    for view, p in zip(acc._buffers.views, ref.parameters(), strict=True):
        torch.testing.assert_close(view, p.grad, **TOL[torch.float64])
    acc.close()


def test_fp16_loss_scaling_with_injected_overflow_equals_hooks_path():
    """An inf in the activations' gradient reaches the fused weight views: the window is skipped, the scale backs
    off, and the next window equals the hooks path's (both run the forward in fp32, so only the scaling differs)."""
    seed, n = 7, 3
    batches = make_batches(2 * n, torch.float32, seed)
    models = {}
    for fused in (False, True):
        model = make_model(torch.float32, seed)
        config = GradientAccumulationConfig(
            accumulation_steps=n,
            mixed_precision="fp16",
            max_grad_norm=1.0,
            init_scale=1024.0,
            gradient_accumulation_fusion=fused,
        )
        acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
        acc._autocast = lambda: torch.autocast("cpu", enabled=False)
        for i, (x, y) in enumerate(batches):
            with acc.micro_step():
                h = model[0](x)
                if i == 1:
                    h.register_hook(lambda g: g * math.inf)  # the middle micro-step of the first window
                acc.backward(F.mse_loss(model[2](torch.tanh(h)), y))
        assert acc.skipped_steps == 1 and acc.optimizer_steps == 1 and acc.loss_scale() == 512.0
        models[fused] = model
    assert_params_close(models[True], models[False], torch.float32)


@pytest.mark.parametrize("mode", ["mean", "sum"])
def test_resume_mid_window_equals_uninterrupted(mode):
    dtype, n, seed, cut = torch.float64, 3, 23, 4
    batches = make_batches(8, dtype, seed)

    def build():
        model = make_model(dtype, seed)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        cfg = GradientAccumulationConfig(accumulation_steps=n, loss_normalization=mode, max_grad_norm=0.4, **FUSION)
        return model, opt, GradientAccumulator(model, opt, cfg)

    def feed(acc, model, chunk):
        for batch in chunk:
            with acc.micro_step():
                acc.backward(*micro_loss(model, batch, mode, n))

    model, _, acc = build()
    feed(acc, model, batches)
    acc.flush()
    model1, opt1, acc1 = build()
    feed(acc1, model1, batches[:cut])
    states = [obj.state_dict() for obj in (model1, opt1, acc1)]
    acc1.close()
    model2, opt2, acc2 = build()
    for obj, state in zip((model2, opt2, acc2), states, strict=True):
        obj.load_state_dict(state)
    feed(acc2, model2, batches[cut:])
    acc2.flush()
    assert_params_close(model2, model, dtype)


class TiedLM(nn.Module):
    """An embedding tied to the LM head. late_embedding: the embedding is used again after a reentrant-
    checkpointed head, so its gradient reaches the buffer (hooks path) before the head's fused write."""

    def __init__(self, late_embedding: bool, vocab: int = 11, d: int = 6) -> None:
        super().__init__()
        self.emb, self.mid, self.head = nn.Embedding(vocab, d), nn.Linear(d, d), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.late = late_embedding

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        if not self.late:
            return self.head(torch.tanh(self.mid(x)))
        logits = checkpoint(
            lambda t: self.head(torch.tanh(self.mid(t))), x.detach().requires_grad_(), use_reentrant=True
        )
        return logits + self.emb(tokens.flip(-1)).sum(-1, keepdim=True)


@pytest.mark.parametrize("late_embedding", [False, True], ids=["head_first", "embedding_first"])
@pytest.mark.parametrize("bucket", [1, 1 << 20])
def test_tied_embedding_and_head_land_in_one_view_counted_once(late_embedding, bucket):
    dtype, n, seed = torch.float64, 2, 19
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randint(0, 11, (3, 4), generator=g), torch.randint(0, 11, (3, 4), generator=g)) for _ in range(4)]

    def lm_loss(model, batch):
        return F.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())

    def build():
        torch.manual_seed(seed)
        return TiedLM(late_embedding).to(dtype)

    model, ref = build(), build()
    cfg = GradientAccumulationConfig(accumulation_steps=n, max_grad_norm=0.5, bucket_size_bytes=bucket, **FUSION)
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), cfg)
    tied = next(i for i, p in enumerate(acc.params) if p is model.emb.weight)
    order = []
    write, add = acc._sums.write_directly, acc._sums.add
    acc._sums.write_directly = lambda i: (order.append(("fused", i)), write(i))[1]
    acc._sums.add = lambda index, *a: (order.extend(("hooks", i) for i in index), add(index, *a))[1]
    for batch in batches:
        with acc.micro_step():
            acc.backward(lm_loss(model, batch))
    tied_order = [k for k, i in order if i == tied][:2]
    # A large bucket queues the embedding's gradient until backward returns: the fused write lands first then.
    assert tied_order == (["hooks", "fused"] if late_embedding and bucket == 1 else ["fused", "hooks"])
    opt, norms = torch.optim.SGD(ref.parameters(), lr=0.5), []
    for start in range(0, len(batches), n):
        opt.zero_grad()
        (sum(lm_loss(ref, b) for b in batches[start : start + n]) / n).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))  # tied: counted once
        opt.step()
    assert_params_close(model, ref, dtype)
    torch.testing.assert_close(acc.grad_norm_history(), torch.stack(norms).float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_equals_full_batch(reentrant):
    dtype, n, seed = torch.float64, 2, 29
    batches = make_batches(4, dtype, seed)
    model, ref = make_model(dtype, seed), make_model(dtype, seed)
    cfg = GradientAccumulationConfig(accumulation_steps=n, **FUSION)
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), cfg)
    for x, y in batches:
        with acc.micro_step():
            out = checkpoint(model, x.requires_grad_(reentrant), use_reentrant=reentrant)
            acc.backward(F.mse_loss(out, y))
    plain_loop(ref, [(x.detach(), y) for x, y in batches], n, "mean")
    assert_params_close(model, ref, dtype)


def test_failed_backward_undoes_fused_first_writes_and_discards_a_mixed_window():
    """A backward that fails after a fused Linear wrote: the window's first micro-step is undone exactly (the
    view is unmarked, as for a hooks-path fold); a later one cannot be, so the window is discarded and the next
    micro_step() refused until discard_window()."""
    dtype, n, seed = torch.float64, 2, 47
    batches = make_batches(4, dtype, seed)
    model, ref = make_model(dtype, seed), make_model(dtype, seed)
    cfg = GradientAccumulationConfig(accumulation_steps=n, **FUSION)
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), cfg)

    def failing_step(batch):
        with pytest.raises(ZeroDivisionError):
            with acc.micro_step():
                h = model[0](batch[0])
                h.register_hook(lambda g: 1 / 0)  # after model[2]'s fused write, before model[0]'s
                acc.backward(F.mse_loss(model[2](torch.tanh(h)), batch[1]))

    failing_step(batches[0])
    assert acc._sums.indices() == [] and acc.micro_steps_in_window == 0
    with acc.micro_step():
        acc.backward(micro_loss(model, batches[0], "mean", n)[0])
    failing_step(batches[1])
    assert acc.micro_steps_in_window == 0
    with pytest.raises(RuntimeError, match="the open window was lost"), acc.micro_step():
        pass
    acc.discard_window()
    for batch in batches:
        with acc.micro_step():
            acc.backward(micro_loss(model, batch, "mean", n)[0])
    plain_loop(ref, batches, n, "mean")
    assert_params_close(model, ref, dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["cuda_bf16", "cuda_fp16"])
def test_cuda_wgrad_op_and_bf16_fused_window(dtype):
    """On CUDA: the op (opcheck, float64 oracle) and a bf16-param model fused with fp32 buffers."""
    assert wgrad.probe(torch.device("cuda")) is None
    g = torch.Generator(device="cpu").manual_seed(5)
    a = torch.randn(33, 65, generator=g).to("cuda", dtype)
    b = torch.randn(65, 17, generator=g).to("cuda", dtype)
    out = torch.randn(33, 17, generator=g).cuda()
    want = out.double() + 0.25 * (a.double() @ b.double())
    torch.ops.gradacc.wgrad_addmm_(out, a, b, 1.0, 0.25)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.library.opcheck(torch.ops.gradacc.wgrad_addmm_.default, (out, a, b, 1.0, 0.5))
    seed, n = 3, 4
    batches = [(x.cuda().to(dtype), y.cuda().to(dtype)) for x, y in make_batches(n, torch.float32, seed)]
    model = make_model(torch.float32, seed).cuda().to(dtype)
    ref = make_model(torch.float32, seed).cuda().to(dtype).double()  # the same (rounded) parameters
    cfg = GradientAccumulationConfig(accumulation_steps=n + 1, loss_normalization="none", **FUSION)  # stays open
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    assert acc.stats.fused_linear_params == 4, acc.stats.linear_fusion_fallbacks
    for xb, yb in batches:
        with acc.micro_step():
            acc.backward(F.mse_loss(model(xb).float(), yb.float()))
        F.mse_loss(ref(xb.double()), yb.double()).backward()
    for v, p, q in zip(acc._buffers.views, model.parameters(), ref.parameters(), strict=True):
        assert v.dtype == torch.float32 and p.grad is None
        torch.testing.assert_close(v.double(), q.grad, rtol=3e-2, atol=3e-3)  # bf16 activations vs float64 ones
    acc.close()


def ddp_worker(rank: int, world: int) -> None:
    for kind in ("mean", "sum", "items"):
        model = nn.parallel.DistributedDataParallel(dist_model())
        opt = dist_optimizer(model.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        mode = "sum" if kind == "sum" else "mean"
        cfg = GradientAccumulationConfig(accumulation_steps=STEPS, max_grad_norm=0.5, loss_normalization=mode, **FUSION)
        acc = GradientAccumulator(model, opt, cfg, sched)
        assert acc.stats.fused_linear_params == 4
        for batch in global_batches(kind, world, seed=5):
            with acc.micro_step():  # no_sync: DDP's reducer never waits for the fused weights' gradients
                acc.backward(*loss_and_items(model, shard(batch, rank)))
        acc.flush()
        assert_params_equal(model.module, dist_reference(kind, world, seed=5), **TOL64)
        acc.close()


@pytest.mark.distributed
@needs_gloo
def test_ddp_buffer_reduce_two_ranks_equals_full_batch():
    """DDP with no_sync micro-steps and the whole-buffer all-reduce: the fused window equals the full batch."""
    launch(ddp_worker, 2, timeout=90)
