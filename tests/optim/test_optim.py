"""The fused optimizers of the test table (FusedAdamW, FusedSGD, FusedLion) as torch.optim optimizers:
equal to their oracle (torch's, lion-pytorch's Lion) on a small model, param groups, checkpoints
both ways, every LR scheduler, GradScaler, 16-bit params with float32 grads, clipping."""

from __future__ import annotations

import copy

import pytest
import torch
from _optim_inputs import OPTIMIZERS
from torch.optim import lr_scheduler as sched

from gradacc_ext.optim import FusedAdamW, FusedLion, FusedSGD

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
TOL = {"rtol": 1e-5, "atol": 1e-6}


def make_model(gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(int(torch.randint(0, 2**31, (), generator=gen)))
    return torch.nn.Sequential(torch.nn.Linear(13, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5)).to(dtype)


def groups(model: torch.nn.Module, **second) -> list[dict]:
    """Two param groups: weights with the defaults, biases with their own options."""
    named = list(model.named_parameters())
    weights, biases = [p for n, p in named if "weight" in n], [p for n, p in named if "bias" in n]
    return [{"params": weights}, {"params": biases, **second}]


def batch(gen: torch.Generator, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (), generator=gen)) + step)
    return torch.randn(16, 13, generator=g), torch.randn(16, 5, generator=g)


def backward(model: torch.nn.Module, data, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    x, y = data
    loss = torch.nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)
    (loss * scale).backward()
    return loss


def train(model, opt, gen_seed: int, steps: int, scheduler=None, clip: float | None = None) -> list[float]:
    gen, lrs = torch.Generator().manual_seed(gen_seed), []
    for step in range(steps):
        opt.zero_grad()
        loss = backward(model, batch(gen, step))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if scheduler is not None:
            scheduler.step(loss.item()) if isinstance(scheduler, sched.ReduceLROnPlateau) else scheduler.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    return lrs


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module, **tol) -> None:
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, **(tol or TOL))


# Per row of the optimizer table: option sets of the fused optimizer and its oracle (each reaching
# other branches), the base options of the shared tests, and what the oracle needs besides.
OPTIONS = {
    "adamw": [{}, {"amsgrad": True, "weight_decay": 0.1}, {"maximize": True, "betas": (0.8, 0.99), "eps": 1e-6}],
    "sgd": [{"momentum": 0.9}, {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
            {"dampening": 0.2, "momentum": 0.5}],
    "lion": [{}, {"weight_decay": 0.1}, {"betas": (0.8, 0.95), "weight_decay": 0.5}],
}  # fmt: skip
BASE = {"adamw": {"lr": 1e-2}, "sgd": {"lr": 0.05, "momentum": 0.9}, "lion": {"lr": 1e-3, "weight_decay": 0.1}}
ORACLE_EXTRA = {"adamw": {"fused": True}}  # torch's fused AdamW: the same roundings as ours
ROW_OPTIONS = [
    pytest.param(info, options, id=f"{info.name}-{i}")
    for info in OPTIMIZERS
    for i, options in enumerate(OPTIONS[info.name])
]
ROWS = [pytest.param(info, id=info.name) for info in OPTIMIZERS]


@pytest.mark.parametrize(("info", "options"), ROW_OPTIONS)
def test_matches_the_oracle_with_param_groups(gen, info, options):
    """Ten steps of the fused optimizer and of the row's oracle (torch.optim's, lion-pytorch's Lion)
    from the same model, two param groups with their own options."""
    ours_model = make_model(gen)
    torch_model = copy.deepcopy(ours_model)
    lr = BASE[info.name]["lr"]
    second = {"lr": lr / 3, "weight_decay": 0.0}
    ours = info.fused(groups(ours_model, **second), lr=lr, **options)
    ref = info.oracle(groups(torch_model, **second), lr=lr, **options, **ORACLE_EXTRA.get(info.name, {}))
    train(ours_model, ours, 1, 10)
    train(torch_model, ref, 1, 10)
    assert_same_params(ours_model, torch_model)


@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
@pytest.mark.parametrize("info", ROWS)
def test_checkpoints_load_both_ways(gen, info, direction):
    """Three steps on one implementation, its state_dict into the other, three more steps: equal to
    six steps on the oracle alone."""
    fused_cls, torch_cls = info.fused, info.oracle
    options = {**BASE[info.name], **({"amsgrad": True} if info.name == "adamw" else {})}
    first_cls, second_cls = (torch_cls, fused_cls) if direction == "torch_to_ours" else (fused_cls, torch_cls)
    model = make_model(gen)
    baseline = copy.deepcopy(model)
    first = first_cls(groups(model, lr=options["lr"] / 3), **options)
    train(model, first, 3, 3)
    second = second_cls(groups(model, lr=123.0), **options)  # the checkpoint's lr must win
    second.load_state_dict(copy.deepcopy(first.state_dict()))
    assert second.param_groups[1]["lr"] == options["lr"] / 3
    train(model, second, 4, 3)

    ref = torch_cls(groups(baseline, lr=options["lr"] / 3), **options)
    train(baseline, ref, 3, 3)
    train(baseline, ref, 4, 3)
    assert_same_params(model, baseline)


SCHEDULERS = {
    "StepLR": lambda o: sched.StepLR(o, 2, 0.5),
    "MultiStepLR": lambda o: sched.MultiStepLR(o, [1, 3], 0.3),
    "ExponentialLR": lambda o: sched.ExponentialLR(o, 0.8),
    "CosineAnnealingLR": lambda o: sched.CosineAnnealingLR(o, 5),
    "CosineAnnealingWarmRestarts": lambda o: sched.CosineAnnealingWarmRestarts(o, 2),
    "LinearLR": lambda o: sched.LinearLR(o, 0.2, total_iters=4),
    "ConstantLR": lambda o: sched.ConstantLR(o, 0.5, total_iters=3),
    "LambdaLR": lambda o: sched.LambdaLR(o, lambda s: 1 / (s + 1)),
    "MultiplicativeLR": lambda o: sched.MultiplicativeLR(o, lambda s: 0.9),
    "PolynomialLR": lambda o: sched.PolynomialLR(o, 5, 2.0),
    "OneCycleLR": lambda o: sched.OneCycleLR(o, 0.05, total_steps=6),
    "CyclicLR": lambda o: sched.CyclicLR(o, 1e-3, 1e-2, step_size_up=2),
    "SequentialLR": lambda o: sched.SequentialLR(o, [sched.ConstantLR(o, 0.5, 2), sched.ExponentialLR(o, 0.9)], [2]),
    "ChainedScheduler": lambda o: sched.ChainedScheduler([sched.StepLR(o, 2, 0.5), sched.ExponentialLR(o, 0.9)]),
    "ReduceLROnPlateau": lambda o: sched.ReduceLROnPlateau(o, factor=0.5, patience=0),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
@pytest.mark.parametrize("info", ROWS)
def test_every_lr_scheduler(gen, info, name):
    """The scheduler sees the same optimizer API as the oracle's: same lr trajectory, same params."""
    model = make_model(gen)
    twin = copy.deepcopy(model)
    options = BASE[info.name]
    ours, ref = info.fused(groups(model), **options), info.oracle(groups(twin), **options)
    lrs = train(model, ours, 5, 6, SCHEDULERS[name](ours))
    assert lrs == train(twin, ref, 5, 6, SCHEDULERS[name](ref))
    assert_same_params(model, twin)


@pytest.mark.parametrize("info", ROWS)
def test_grad_scaler_protocol_and_overflow_skip(gen, info):
    """torch.amp.GradScaler hands the scale and found_inf to the step (no unscale pass); an
    overflow leaves params and state bitwise untouched and the scaler backs off."""
    model = make_model(gen)
    twin = copy.deepcopy(model)
    options = BASE[info.name]
    ours = info.fused(model.parameters(), **options)
    ref = info.oracle(twin.parameters(), **options, **ORACLE_EXTRA.get(info.name, {}))
    assert info.fused._step_supports_amp_scaling
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**12), torch.amp.GradScaler("cpu", init_scale=2.0**12)]
    data_gen = torch.Generator().manual_seed(6)
    for step in range(5):
        data = batch(data_gen, step)
        for m, opt, scaler in zip((model, twin), (ours, ref), scalers, strict=True):
            opt.zero_grad()
            backward(m, data, scaler.scale(torch.ones(())))
            if step == 3:  # an overflow in one grad
                next(m.parameters()).grad[0, 0] = float("inf")
            before = [p.detach().clone() for p in m.parameters()], copy.deepcopy(opt.state_dict()["state"])
            scaler.step(opt)
            scaler.update()
            if step == 3:
                assert all(torch.equal(a, p) for a, p in zip(before[0], m.parameters(), strict=True))
                # step counts (where kept: torch's SGD and lion-pytorch keep none) and state untouched
                after = opt.state_dict()["state"]
                assert after.keys() == before[1].keys()
                for key, state in after.items():
                    assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(before[1][key][k]))
                               for k, v in state.items() if v is not None)  # fmt: skip
    assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0**11
    assert_same_params(model, twin)


def test_bf16_params_with_fp32_grads_follow_fp32_training_via_master_weights(gen):
    """A bf16 param whose .grad is float32 (Tensor.grad_dtype): in "master" mode the master
    weights take exactly the fp32 AdamW trajectory and the param is their rounding."""
    model = make_model(gen)
    low = copy.deepcopy(model).to(torch.bfloat16)
    for p_low, p in zip(low.parameters(), model.parameters(), strict=True):
        p.data.copy_(p_low.detach().float())  # both start from bf16-representable weights
        p_low.grad_dtype = torch.float32
    ours = FusedAdamW(low.parameters(), lr=1e-2, param_mode="master")
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for step in range(4):
        ref.zero_grad()
        backward(model, batch(gen, step))
        for p_low, p in zip(low.parameters(), model.parameters(), strict=True):
            p_low.grad = p.grad.clone()  # the same fp32 grads, so the trajectories must agree
        ours.step()
        ref.step()
    for p_low, p in zip(low.parameters(), model.parameters(), strict=True):
        master = ours.state[p_low]["master_param"]
        assert p_low.grad.dtype == torch.float32 and ours.state[p_low]["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(master, p.detach(), **TOL)
        assert torch.equal(p_low.detach(), master.to(torch.bfloat16))


@pytest.mark.parametrize("info", ROWS)
def test_max_grad_norm_equals_clip_grad_norm(gen, info):
    model = make_model(gen)
    twin = copy.deepcopy(model)
    options = BASE[info.name]
    ours = info.fused(model.parameters(), **options, max_grad_norm=0.1)
    train(model, ours, 7, 5)
    train(twin, info.oracle(twin.parameters(), **options), 7, 5, clip=0.1)
    assert_same_params(model, twin)
    assert ours.last_grad_norm is not None and float(ours.last_grad_norm) > 0.1  # it did clip


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: FusedAdamW(p, lr=-1.0), "Invalid learning rate"),
        (lambda p: FusedAdamW(p, betas=(1.0, 0.9)), "Invalid beta parameter at index 0"),
        (lambda p: FusedAdamW(p, eps=-1.0), "Invalid epsilon value"),
        (lambda p: FusedAdamW(p, weight_decay=-1.0), "Invalid weight_decay value"),
        (lambda p: FusedSGD(p, momentum=-1.0), "Invalid momentum value"),
        (lambda p: FusedSGD(p, nesterov=True), "Nesterov momentum requires"),
        (lambda p: FusedAdamW(p, param_mode="bf16"), "param_mode must be one of"),
        (lambda p: FusedAdamW(p, max_grad_norm=0.0), "max_grad_norm"),
        (lambda p: FusedAdamW(p, differentiable=True), "differentiable"),
        (lambda p: FusedLion(p, betas=(0.9, 1.0)), "Invalid beta parameter at index 1"),
        (lambda p: FusedLion(p, weight_decay=-0.1), "Invalid weight_decay value"),
        (lambda p: FusedLion(p, lr=-1.0), "Invalid learning rate"),
    ],
)
def test_constructor_rejects_bad_options(gen, make, match):
    with pytest.raises(ValueError, match=match):
        make(make_model(gen).parameters())


def test_sparse_grad_is_rejected_before_anything_is_written(gen):
    model = make_model(gen)
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    backward(model, batch(gen, 0))
    params = list(model.parameters())
    params[-1].grad = params[-1].grad.to_sparse()
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, params, strict=True)) and not opt.state


def test_200_steps_with_clipping_and_scheduler_equal_torch(gen):
    """The training check: 200 fp32 steps with global-norm clipping inside the step and a cosine
    schedule, against torch AdamW + clip_grad_norm_: equal within 1e-5 relative."""
    model = make_model(gen)
    twin = copy.deepcopy(model)
    ours = FusedAdamW(groups(model, weight_decay=0.0), lr=3e-3, max_grad_norm=0.5)
    ref = torch.optim.AdamW(groups(twin, weight_decay=0.0), lr=3e-3)
    steps = 200
    train(model, ours, 8, steps, sched.CosineAnnealingLR(ours, steps))
    train(twin, ref, 8, steps, sched.CosineAnnealingLR(ref, steps), clip=0.5)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5 * float(q.detach().abs().max()))
