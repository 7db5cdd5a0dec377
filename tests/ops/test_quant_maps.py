"""The int8 optimizer states' code books: csrc/kernels/quant_maps.h is exactly what scripts/gen_quant_maps.py
writes from gradacc_ext/ops/quant_maps.py, and the tables have the properties the encoder relies on."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from gradacc_ext.ops import quant_maps

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_quant_maps.py"

pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="needs the source tree (scripts/)")


def _generator():
    spec = importlib.util.spec_from_file_location("gen_quant_maps", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_header_equals_the_generator_output():
    gen = _generator()
    assert gen.HEADER.read_text() == gen.render(), "run python scripts/gen_quant_maps.py"


@pytest.mark.parametrize("signed", [True, False])
def test_header_literals_are_the_python_tables(signed):
    """Each hex literal parses back to the float32 table's value, bit for bit."""
    text = (ROOT / "csrc" / "kernels" / "quant_maps.h").read_text()
    label = "Signed" if signed else "Unsigned"
    for name, table in (("Codes", quant_maps.code_values(signed)), ("Midpoints", quant_maps.midpoints(signed))):
        body = re.search(rf"k{label}{name}\[\d+\] = \{{(.*?)\}};", text, re.S).group(1)
        values = [float.fromhex(v.strip().rstrip("f")) for v in body.split(",")]
        assert torch.equal(torch.tensor(values, dtype=torch.float32), table)


@pytest.mark.parametrize("signed", [True, False])
def test_tables_are_ascending_and_midpoints_between_codes(signed):
    codes, mids = quant_maps.code_values(signed), quant_maps.midpoints(signed)
    assert codes.numel() == 256 and mids.numel() == 255
    assert bool((codes[1:] > codes[:-1]).all()) and bool((mids > codes[:-1]).all() and (mids < codes[1:]).all())
    assert float(codes[quant_maps.zero_code(signed)]) == 0.0 and float(codes.abs().max()) == 1.0
