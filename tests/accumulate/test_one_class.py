"""Issue 29 section 2: one public class of each name, with one constructor story.

GradientAccumulator, AdaptiveGradientAccumulator and GradientAccumulationConfig are each one class,
whichever way they are imported (gradacc_ext, gradacc_ext.compat, gradacc_ext.accumulate, the Lightning
callback's module); the accumulator is built in one call or as (config) then attach(), with no
__getattr__ trap; the guides' config spellings are that one config class's from_guide().
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil

import pytest
import torch
from _cases import make_batches, make_model, mse

import gradacc_ext
import gradacc_ext.compat as compat
from gradacc_ext.accumulate.accumulator import GradientAccumulator as CoreModuleAccumulator
from gradacc_ext.accumulate.attachment import NotAttachedError

NAMES = ("GradientAccumulator", "AdaptiveGradientAccumulator", "GradientAccumulationConfig")


def _package_classes(name: str) -> list[str]:
    """Every class called `name` that a gradacc_ext module defines (integrations/ needs lightning, __main__ runs
    the command line: both skipped)."""
    found = []
    for info in pkgutil.walk_packages(gradacc_ext.__path__, "gradacc_ext."):
        if info.name.startswith("gradacc_ext.integrations") or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        found += [
            f"{info.name}.{name}"
            for obj_name, obj in vars(module).items()
            if obj_name == name and inspect.isclass(obj) and obj.__module__ == info.name
        ]
    return found


@pytest.mark.parametrize("name", NAMES)
def test_the_package_defines_one_class_of_each_name(name):
    assert len(_package_classes(name)) == 1, _package_classes(name)


def test_every_import_path_gives_the_same_class():
    from gradacc_ext import accumulate

    for name in ("GradientAccumulator", "AdaptiveGradientAccumulator"):
        assert getattr(gradacc_ext, name) is getattr(compat, name) is getattr(accumulate, name)
    assert CoreModuleAccumulator is gradacc_ext.GradientAccumulator  # what the Lightning callback imports
    config = compat.GradientAccumulationConfig(gradient_clipping=1.0)  # the guides' spelling
    assert type(config) is gradacc_ext.GradientAccumulationConfig is accumulate.GradientAccumulationConfig
    # the same window as the core spelling: the guide's record does not take part in equality
    assert config == gradacc_ext.GradientAccumulationConfig(accumulation_steps=4, max_grad_norm=1.0)
    assert issubclass(gradacc_ext.AdaptiveGradientAccumulator, gradacc_ext.GradientAccumulator)


def test_no_getattr_trap_anywhere_in_the_accumulators():
    for cls in (gradacc_ext.GradientAccumulator, gradacc_ext.AdaptiveGradientAccumulator):
        assert not [k.__name__ for k in cls.__mro__ if "__getattr__" in vars(k)]


def test_config_first_then_attach_equals_one_call_construction():
    config = gradacc_ext.GradientAccumulationConfig(accumulation_steps=3, max_grad_norm=0.5)
    one, two = make_model(torch.float64, 40), make_model(torch.float64, 40)
    batches = make_batches(7, 4, torch.float64, 41)
    now = CoreModuleAccumulator(one, torch.optim.SGD(one.parameters(), lr=0.1), config)
    later = CoreModuleAccumulator(config)
    assert not later.attached and not hasattr(later, "optimizer")
    with pytest.raises(NotAttachedError, match=r"_stepper: the accumulator has no model and optimizer yet"):
        later.flush()
    later.attach(two, torch.optim.SGD(two.parameters(), lr=0.1))
    for acc, model in ((now, one), (later, two)):
        for batch in batches:
            with acc.micro_step():
                acc.backward(mse(model, batch))
        acc.flush()
        assert acc.optimizer_steps == 3  # 3 + 3 + a short window of 1
    for p, q in zip(one.parameters(), two.parameters(), strict=True):
        assert torch.equal(p, q)


def test_adaptive_checks_its_sizes_at_construction_and_attaches_later():
    config = gradacc_ext.GradientAccumulationConfig(accumulation_steps=2)
    with pytest.raises(ValueError, match="micro_batch_size must be an integer >= 1"):
        gradacc_ext.AdaptiveGradientAccumulator(config, micro_batch_size=0)  # before any model is given
    acc = gradacc_ext.AdaptiveGradientAccumulator(config, micro_batch_size=2)
    model, twin = make_model(torch.float64, 42), make_model(torch.float64, 42)
    acc.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    plain = gradacc_ext.GradientAccumulator(twin, torch.optim.SGD(twin.parameters(), lr=0.1), config)
    for batch in make_batches(4, 6, torch.float64, 43):
        acc.step_batch(batch, mse)  # in chunks of 2: each a third of the micro-batch
        plain.step_batch(batch, mse)
    assert acc.optimizer_steps == plain.optimizer_steps == 2
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_the_config_class_keeps_its_strict_constructor_and_reads_guides_in_from_guide():
    Config = gradacc_ext.GradientAccumulationConfig
    with pytest.raises(TypeError, match="gradient_clipping"):
        Config(accumulation_steps=2, gradient_clipping=1.0)  # a guide spelling is from_guide's, not a field
    with pytest.raises(ValueError, match="needs accumulation_steps"):
        Config()  # no guide default here
    core = Config(accumulation_steps=2)
    assert core.guide is None and core.strategy == "standard" and core.guide_notes == {}
    assert "adaptive_accumulation" not in core.to_dict()
    guide = Config.from_guide(adaptive_accumulation=True, memory_efficient=True)
    assert (
        guide.accumulation_steps == 4
        and guide.strategy == "adaptive"
        and set(guide.guide_notes) == {"memory_efficient"}
    )
    echoed = guide.to_dict()
    assert echoed["memory_efficient"] is True and echoed["adaptive_accumulation"] is True
    copy = dataclasses.replace(guide, accumulation_steps=8)  # a plain config of the same class
    assert copy.accumulation_steps == 8 and copy.guide is None
