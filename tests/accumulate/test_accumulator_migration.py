"""What a user migrating a loop or pasting guide code runs into: construction forms, an optimizer over
other parameters, GradScaler acceptance, the ecosystem's spellings, and the one-time warnings."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from _cases import make_batches, make_model, mse

from gradacc_ext import GradientAccumulationConfig, GradientAccumulator


def config(**kw) -> GradientAccumulationConfig:
    return GradientAccumulationConfig(**{"accumulation_steps": 2, **kw})


def test_config_first_then_attach_and_errors_before_it():
    model = make_model(torch.float32, 1)
    acc = GradientAccumulator(config())
    assert not acc.attached
    with pytest.raises(AttributeError, match=r"no model and optimizer yet; give them with attach\(model, optimizer\)"):
        acc.flush()
    with pytest.raises(TypeError, match="optimizer is missing"):
        acc.attach(model, None)
    acc.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="already has its model"):
        acc.attach(model, acc.optimizer)
    with GradientAccumulator(config()) as never_attached:  # closing one that never got a model is a no-op
        assert not never_attached.attached
    with pytest.raises(TypeError, match="scheduler and scaler are given with the model"):
        GradientAccumulator(config(), scheduler=object())


def test_optimizer_over_other_parameters_is_refused_and_a_partial_one_warned():
    model, other = make_model(torch.float32, 2), make_model(torch.float32, 3)
    acc = GradientAccumulator(config())
    with pytest.raises(ValueError, match=r"holds none of the 4 trainable parameters of the model \(it holds 4 other"):
        acc.attach(model, torch.optim.SGD(other.parameters(), lr=0.1))
    assert not acc.attached and "module" not in vars(acc)  # nothing was set on the error path
    with pytest.warns(UserWarning, match=r"2 of the 4 trainable parameters of the model are not in the optimizer "
                      r"\(2.weight, 2.bias\)"):  # fmt: skip
        GradientAccumulator(model, torch.optim.SGD(model[0].parameters(), lr=0.1), config())


def test_both_guide_orders_and_attach_on_the_first_call_are_the_one_class_own():
    """The guides' accumulate_gradients shapes are gradacc_ext.GradientAccumulator's own (one class)."""
    model = make_model(torch.float32, 4)
    x, y = make_batches(1, 3, torch.float32, 4)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="optimizer is missing"):  # attaching on the first call needs both
        GradientAccumulator(config()).accumulate_gradients(mse(model, (x, y)), model)
    first = GradientAccumulator(config())
    out = first.accumulate_gradients(model, mse(model, (x, y)), 3, opt)  # seed 001's order attaches it
    assert first.attached and out["accumulation_step"] == 1 and not out["should_step"]
    out = first.accumulate_gradients(mse(model, (x, y)), model, opt, num_items=3)  # seed 000's order, the same one
    assert out["should_step"] and first.optimizer_steps == 1
    with pytest.raises(ValueError, match="the optimizer passed is not the one"):
        first.accumulate_gradients(mse(model, (x, y)), model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_disabled_scaler_means_no_loss_scaling_in_every_mode(caplog):
    for mode in ("no", "bf16", "fp16"):
        model = make_model(torch.float32, 5)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with caplog.at_level(logging.INFO, logger="gradacc_ext"):
            caplog.clear()
            acc = GradientAccumulator(
                model, opt, config(mixed_precision=mode), scaler=torch.amp.GradScaler("cpu", enabled=False)
            )
        assert acc.loss_scale() is None
        assert [r.getMessage() for r in caplog.records] == [
            "GradientAccumulator: the GradScaler passed is disabled (enabled=False): no loss scaling"
        ]


@pytest.mark.parametrize(
    "mode,scaler_kw,config_kw,match",
    [
        ("fp16", {"growth_interval": 2000}, {"growth_interval": 100}, "has growth_interval=2000 but config.growth"),
        ("fp16", {"init_scale": 1024.0}, {"init_scale": 8.0}, "has init_scale=1024.0 but config.init_scale=8.0"),
    ],
)
def test_scaler_settings_that_contradict_the_config_name_the_field(mode, scaler_kw, config_kw, match):
    model = make_model(torch.float32, 6)
    scaler = torch.amp.GradScaler("cpu", **scaler_kw)
    with pytest.raises(ValueError, match=match):
        GradientAccumulator(
            model, torch.optim.SGD(model.parameters(), lr=0.1), config(mixed_precision=mode, **config_kw), scaler=scaler
        )


def test_scaler_matching_the_config_is_used():
    model = make_model(torch.float32, 6)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    acc = GradientAccumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), config(mixed_precision="fp16", init_scale=1024.0), scaler
    )
    assert acc.loss_scale() == 1024.0


@pytest.mark.parametrize(
    "value,expected",
    [(torch.float32, "no"), ("float32", "no"), (torch.bfloat16, "bf16"), ("bfloat16", "bf16"),
     (torch.float16, "fp16"), ("float16", "fp16"), ("bf16", "bf16")],
)  # fmt: skip
def test_mixed_precision_spellings(value, expected):
    assert config(mixed_precision=value).mixed_precision == expected


def test_max_grad_norm_zero_is_off_and_negative_is_still_an_error():
    assert config(max_grad_norm=0.0).max_grad_norm is None and config(max_grad_norm=0).max_grad_norm is None
    with pytest.raises(ValueError, match="max_grad_norm must be a finite number > 0"):
        config(max_grad_norm=-1.0)


def test_loss_normalization_none_sums_the_window_and_refuses_num_items():
    model, twin = make_model(torch.float64, 7), make_model(torch.float64, 7)
    batches = make_batches(3, 4, torch.float64, 7)  # 2 + a short window of 1
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), config(loss_normalization="none"))
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    for i, batch in enumerate(batches):
        with acc.micro_step():
            acc.backward(mse(model, batch) / 2)
        (mse(twin, batch) / 2).backward()  # the hand-written loop: a short last window weighs k/N
        if i % 2 == 1 or i == len(batches) - 1:
            opt.step()
            opt.zero_grad()
    acc.flush()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    with acc.micro_step(), pytest.raises(ValueError, match="num_items cannot be given with loss_normalization='none'"):
        acc.backward(mse(model, batches[0]), num_items=4)


def test_mixed_precision_forward_outside_micro_step_warns_once():
    model = make_model(torch.float32, 8)
    batches = make_batches(4, 3, torch.float32, 8)
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), config(mixed_precision="bf16"))
    with pytest.warns(UserWarning, match="forward ran without autocast") as record:
        for batch in batches[:2]:
            acc.backward(mse(model, batch))  # forward outside micro_step(): fp32
    assert len([r for r in record if "autocast" in str(r.message)]) == 1
    twin = make_model(torch.float32, 8)
    quiet = GradientAccumulator(twin, torch.optim.SGD(twin.parameters(), lr=0.1), config(mixed_precision="bf16"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the user's own autocast is fine
            loss = mse(quiet.module, batches[0])
        quiet.backward(loss)
        with quiet.micro_step():
            quiet.backward(mse(quiet.module, batches[1]))


def test_discard_window_drops_the_open_window():
    model = make_model(torch.float32, 9)
    before = [p.detach().clone() for p in model.parameters()]
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), config(accumulation_steps=3))
    batches = make_batches(4, 3, torch.float32, 9)
    for batch in batches[:2]:
        with acc.micro_step():
            acc.backward(mse(model, batch))
    acc.discard_window()
    assert acc.micro_steps_in_window == 0 and acc.flush() is False
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_update_config_between_windows_only():
    model = make_model(torch.float32, 10)
    acc = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), config())
    assert acc.update_config(accumulation_steps=3, gradient_clipping=0.5) == {
        "accumulation_steps": 3,
        "max_grad_norm": 0.5,
    }
    with acc.micro_step():
        acc.backward(mse(model, make_batches(1, 3, torch.float32, 10)[0]))
    with pytest.raises(RuntimeError, match="mid-window"):
        acc.update_config(accumulation_steps=4)
    with pytest.raises(ValueError, match=r"\['mixed_precision'\] cannot change"):
        acc.update_config(mixed_precision="bf16")
    assert acc.sync_gradients is False and acc.config.accumulation_steps == 3
