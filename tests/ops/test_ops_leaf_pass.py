"""The public ops' leaf check reads requires_grad in one compiled pass (csrc/requires_grad.h): it must agree
with Python's attribute lookup on every kind of list item, and the check built on it must refuse exactly
the leaves that require grad, naming the first."""

from __future__ import annotations

import pytest
import torch
from _devices import require_ext
from torch.overrides import TorchFunctionMode

import gradacc_ext.ops as gops
from gradacc_ext.ops import _aliasing, _loader


class FlagsRequireGrad(torch.Tensor):
    """A subclass whose requires_grad says True whatever the tensor's flag: the attribute lookup must win."""

    @property
    def requires_grad(self) -> bool:  # type: ignore[override]
        return True


def native_pass(tensors: list) -> bool:
    require_ext("cpu")
    return _loader._C.module.any_requires_grad(tensors, torch.Tensor, torch._C.TensorBase)


def items(gen: torch.Generator) -> dict[str, object]:
    leaf = torch.randn(3, generator=gen).requires_grad_()
    return {
        "plain": torch.randn(3, generator=gen),
        "leaf": leaf,
        "non-leaf": leaf * 2,
        "parameter": torch.nn.Parameter(torch.randn(3, generator=gen)),
        "frozen parameter": torch.nn.Parameter(torch.randn(3, generator=gen), requires_grad=False),
        "subclass": torch.randn(3, generator=gen).as_subclass(FlagsRequireGrad),
        "detached": leaf.detach(),
    }


@pytest.mark.parametrize("kind", list(items(torch.Generator().manual_seed(0))))
@pytest.mark.parametrize("where", [0, 5, 9])
def test_native_pass_agrees_with_the_attribute(gen, kind, where):
    tensors: list = [torch.randn(2, generator=gen) for _ in range(10)]
    tensors[where] = items(gen)[kind]
    tensors[(where + 1) % 10] = None  # skipped: the op's validation names it
    expected = any(t.requires_grad for t in tensors if t is not None)
    assert native_pass(tensors) is expected


def test_native_pass_raises_the_attribute_error():
    with pytest.raises(AttributeError, match="'int' object has no attribute 'requires_grad'"):
        native_pass([torch.zeros(1), 3])


class EmptiesItsList(torch.Tensor):
    """A subclass whose requires_grad runs Python that empties the list being read, as an override may."""

    LIST: list = []

    @property
    def requires_grad(self) -> bool:  # type: ignore[override]
        EmptiesItsList.LIST.clear()
        return False


def test_native_pass_survives_a_list_changed_while_it_reads():
    """Each item is held while its flag is read, and the list's size read again each step: no crash, and the
    items gone are not read (as Python's own iteration would)."""
    tensors: list = [torch.zeros(1).as_subclass(EmptiesItsList), torch.zeros(1).requires_grad_()]
    EmptiesItsList.LIST = tensors
    assert native_pass(tensors) is False and tensors == []


def test_native_pass_refuses_other_arguments():
    with pytest.raises(TypeError, match="any_requires_grad"):
        native_pass((torch.zeros(1),))  # a tuple: the Python pass takes those


@pytest.mark.parametrize("kind", ["leaf", "parameter"])
def test_check_leaves_names_the_first_leaf(gen, kind):
    require_ext("cpu")
    tensors: list = [torch.randn(2, generator=gen) for _ in range(6)]
    tensors[1] = items(gen)["non-leaf"]  # requires grad but is no leaf: allowed
    tensors[4] = items(gen)[kind]
    with pytest.raises(RuntimeError, match=r"gradacc.unscale_: tensors\[4\] is a leaf tensor that requires grad"):
        _aliasing.check_leaves("gradacc.unscale_", tensors=tensors)
    with torch.no_grad():
        _aliasing.check_leaves("gradacc.unscale_", tensors=tensors)  # no grad mode: nothing to refuse
    tensors[4] = items(gen)["detached"]
    _aliasing.check_leaves("gradacc.unscale_", tensors=tensors)


class Subclass(torch.Tensor):
    """A subclass without overrides: its items take the attribute lookup, not the getter called directly."""


@pytest.mark.parametrize("leaf_at", [0, 1, 2])
def test_public_op_refuses_a_leaf_among_a_subclass_and_none(gen, leaf_at):
    """Three items in grad mode: a subclass item, a None item and a leaf that requires grad (itself a subclass
    at 0, a Parameter at 1, a plain tensor at 2); the leaf is named before the None is, on both backends."""
    require_ext("cpu")
    tensors: list = [torch.randn(4, generator=gen).as_subclass(Subclass), None, torch.randn(4, generator=gen)]
    tensors[leaf_at] = {
        0: lambda: torch.randn(4, generator=gen).as_subclass(Subclass).requires_grad_(),
        1: lambda: torch.nn.Parameter(torch.randn(4, generator=gen)),
        2: lambda: torch.randn(4, generator=gen).requires_grad_(),
    }[leaf_at]()
    for backend in ("ext", "torch"):
        with pytest.raises(RuntimeError, match=rf"gradacc.unscale_: tensors\[{leaf_at}\] is a leaf tensor"):
            gops.unscale_(tensors, torch.ones(1), torch.zeros(1), backend=backend)


class FlagsEverything(TorchFunctionMode):
    """A mode that answers every requires_grad read with True and counts the reads."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func == torch.Tensor.requires_grad.__get__:
            self.reads += 1
            return True
        return func(*args, **(kwargs or {}))


def test_native_pass_goes_through_a_torch_function_mode(gen):
    """The getter called directly still honours a TorchFunctionMode, as the attribute lookup does."""
    tensors = [torch.randn(2, generator=gen) for _ in range(3)]
    assert native_pass(tensors) is False
    with FlagsEverything() as mode:
        assert native_pass(tensors) is True and mode.reads == 1
        assert tensors[0].requires_grad is True  # the attribute lookup agrees


class EmptiesTheList(TorchFunctionMode):
    """A mode whose requires_grad read empties the list being read."""

    def __init__(self, tensors: list) -> None:
        super().__init__()
        self.tensors = tensors

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func == torch.Tensor.requires_grad.__get__:
            self.tensors.clear()
        return func(*args, **(kwargs or {}))


def test_native_pass_survives_a_mode_that_changes_the_list(gen):
    tensors: list = [torch.randn(2, generator=gen), torch.randn(2, generator=gen).requires_grad_()]
    with EmptiesTheList(tensors):
        assert native_pass(tensors) is False and tensors == []


def test_native_pass_follows_a_patched_tensor_requires_grad(gen, monkeypatch):
    """A plain tensor's getter is called directly only while torch.Tensor finds TensorBase's own descriptor:
    patched, the attribute lookup decides."""
    tensors = [torch.randn(2, generator=gen) for _ in range(3)]
    monkeypatch.setattr(torch.Tensor, "requires_grad", property(lambda self: True), raising=False)
    assert native_pass(tensors) is True
