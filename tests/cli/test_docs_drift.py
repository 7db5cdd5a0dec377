"""The docs cannot drift from the code: every op and optimizer the package registers is on the API, ops,
selftest and layout pages, every file docs/layout.md names exists, and every module, script and C++ source
of the repository is named there.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import gradacc_ext.optim
from gradacc_ext.cli.selftest_kernels import KERNELS
from gradacc_ext.ops import extension_loaded

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

pytestmark = pytest.mark.skipif(not (DOCS / "layout.md").exists(), reason="needs the source tree (docs/)")

# Registered under gradacc:: but not kernels: build introspection (gradacc info reads them).
BUILD_INFO_OPS = {"compiled_info", "cpu_isa", "init_cpu_isa", "set_cpu_isa", "supported_cpu_isa"}
# wgrad_addmm_ is a Python custom op over torch's own GEMM (the Linear fusion's); no kernel of ours to selftest.
NOT_A_KERNEL = {"wgrad_addmm_"}
# The source files the layout page must name, by folder and suffix.
NAMED_SOURCES = [("gradacc_ext", "*.py"), ("scripts", "*"), ("csrc", "*.cpp"), ("csrc", "*.h"), ("csrc", "*.cuh"),
                 ("csrc", "*.cu")]  # fmt: skip


def _page(name: str) -> str:
    return (DOCS / name).read_text()


def _registered_kernel_ops() -> set[str]:
    names = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("gradacc::")}
    return names - BUILD_INFO_OPS - NOT_A_KERNEL


def _fused_optimizers() -> set[str]:
    return {
        name
        for name, obj in vars(gradacc_ext.optim).items()
        if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)
    }


@pytest.mark.skipif(not extension_loaded(), reason="the registered ops are read from the compiled extension")
def test_selftest_runs_every_registered_kernel_op():
    assert {k.name for k in KERNELS} == _registered_kernel_ops()


@pytest.mark.parametrize("page", ["api/index.md", "layout.md", "gpu.md"])
def test_every_kernel_op_is_on_the_page(page):
    text = _page(page)
    missing = [k.name for k in KERNELS if f"`{k.name}`" not in text and f"{k.name}" not in text]
    assert not missing, f"docs/{page} does not name {missing}"


def test_every_kernel_op_is_on_its_ops_page():
    text = _page("ops.md") + _page("optimizers.md")
    missing = [k.name for k in KERNELS if f"`{k.name}" not in text]
    assert not missing, f"docs/ops.md and docs/optimizers.md do not name {missing}"


@pytest.mark.parametrize("page", ["api/index.md", "optimizers.md", "layout.md"])
def test_every_fused_optimizer_is_on_the_page(page):
    text = _page(page)
    missing = sorted(name for name in _fused_optimizers() if name not in text)
    assert not missing, f"docs/{page} does not name {missing}"


def _named_files(text: str) -> set[str]:
    names = set(re.findall(r"[\w./-]*\w\.(?:py|cpp|cuh|cu|h|sh|md|toml|yml)\b", text))
    # "binding.cpp/.h" names binding.h too
    return names | {f"{stem}.{ext}" for stem, ext in re.findall(r"([\w/-]*\w)\.\w+/\.(\w+)\b", text)}


def test_every_file_layout_names_exists():
    files = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]
    named = _named_files(_page("layout.md"))
    missing = sorted(n for n in named if not any(f == n or f.endswith("/" + n) for f in files))
    assert not missing, f"docs/layout.md names files that do not exist: {missing}"


def test_every_module_script_and_source_is_in_layout():
    named = {Path(n).name for n in _named_files(_page("layout.md"))}
    sources = [p for folder, pattern in NAMED_SOURCES for p in (ROOT / folder).rglob(pattern) if p.is_file()]
    missing = sorted(
        p.relative_to(ROOT).as_posix()
        for p in sources
        if p.name not in named and p.name != "__init__.py" and p.suffix not in (".so", ".pyc")
        and "__pycache__" not in p.parts and not p.name.startswith("_build_config")
    )  # fmt: skip
    assert not missing, f"docs/layout.md does not name {missing}"
