"""The core ops' records (gradacc_ext.ops.core_args) are their compiled schemas, and what derives from them
(the fake kernels, `gradacc info`'s op list, the public ops' defaults) follows them."""

from __future__ import annotations

import inspect

import pytest
import torch
from _devices import require_ext

from gradacc_ext import ops
from gradacc_ext.cli import envinfo
from gradacc_ext.ops.core_args import CORE_RECORDS, Accumulate, CoreOp
from gradacc_ext.ops.optim_args import RECORDS

# The public schemas as released: csrc/core_ops.h generates them, and must keep generating them
# character for character.
RELEASED_SCHEMAS = {
    "accumulate_": "gradacc::accumulate_(Tensor(a!)[] bufs, Tensor[] grads, float alpha, Tensor? alpha_tensor, "
    "bool assign) -> ()",
    "accumulate_final_": "gradacc::accumulate_final_(Tensor(a!)[] bufs, Tensor[] grads, float alpha, "
    "Tensor? alpha_tensor, bool assign, Tensor(b!) found_inf, Tensor(c!) norm_acc, float norm_type) -> ()",
    "global_norm": "gradacc::global_norm(Tensor[] tensors, float norm_type, bool per_tensor) -> (Tensor, Tensor)",
    "unscale_": "gradacc::unscale_(Tensor(a!)[] tensors, Tensor inv_scale, Tensor(b!) found_inf) -> ()",
    "clip_by_norm_": "gradacc::clip_by_norm_(Tensor(a!)[] tensors, Tensor total_norm, float max_norm, float eps) -> ()",
    "clip_by_value_": "gradacc::clip_by_value_(Tensor(a!)[] tensors, float clip_value) -> ()",
}


def _schema(record: type[CoreOp]):
    return getattr(torch.ops.gradacc, record.NAME).default._schema


def test_every_core_op_has_one_record():
    assert sorted(r.NAME for r in CORE_RECORDS) == sorted(RELEASED_SCHEMAS)


@pytest.mark.parametrize("record", CORE_RECORDS, ids=lambda r: r.NAME)
def test_record_is_the_schema(record):
    """Names in order, the written arguments, and which are lists: record.args() is the op's positional call."""
    require_ext("cpu")
    arguments = _schema(record).arguments
    assert record.ORDER == tuple(a.name for a in arguments)
    assert record.OUTPUTS == tuple(a.name for a in arguments if a.alias_info is not None and a.alias_info.is_write)
    assert record.LISTS == tuple(a.name for a in arguments if str(a.type) == "List[Tensor]")


@pytest.mark.parametrize("name", list(RELEASED_SCHEMAS))
def test_released_schemas_are_unchanged(name):
    require_ext("cpu")
    assert str(getattr(torch.ops.gradacc, name).default._schema) == RELEASED_SCHEMAS[name]


# The public ops' names for schema arguments that they spell otherwise.
PUBLIC_SPELLING = {"scale": "alpha"}


@pytest.mark.parametrize("record", CORE_RECORDS, ids=lambda r: r.NAME)
def test_public_defaults_are_the_records(record):
    """A public op's argument that is a schema argument (by its name, or its public spelling) defaults to the
    record's default: the signatures carry literals, for the API page, and this holds them to the records."""
    public = inspect.signature(getattr(ops, record.NAME)).parameters
    for name, parameter in public.items():
        field = PUBLIC_SPELLING.get(name, name)
        if field in record.ORDER and parameter.default is not inspect.Parameter.empty:
            assert parameter.default == getattr(record, field), name


def test_info_lists_every_op():
    assert envinfo.OPS == tuple(r.NAME for r in (*CORE_RECORDS, *RECORDS))


def test_positional_call_round_trips():
    bufs, grads = [torch.zeros(3)], [torch.ones(3)]
    record = Accumulate(bufs=bufs, grads=grads, alpha=0.5)
    assert record.args() == (bufs, grads, 0.5, None, False)
    assert Accumulate.from_args(*record.args()) == record
