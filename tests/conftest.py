"""Fixtures shared by the test files: devices, backends and a per-test random generator."""

from __future__ import annotations

import zlib

import pytest
import torch
from _cuda_ids import cuda_tests_without_cuda_id
from _devices import DEVICES, require_ext
from _oracle import cpu_threads


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Fails the collection on a test that needs CUDA but has no "cuda" in its id (tests/_cuda_ids.py)."""
    missing = cuda_tests_without_cuda_id(items)
    if missing:
        listed = "\n  ".join(missing[:20])
        raise pytest.UsageError(
            f"{len(missing)} test(s) need CUDA but have no 'cuda' in their id, so `-k cuda` (scripts/gpu_verify.sh) "
            f"would never run them; put 'cuda' in the test's name or parameter id:\n  {listed}"
        )


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=["ext", "torch"])
def backend(request: pytest.FixtureRequest, device: str) -> str:
    """Both backends on every device: "ext" is the compiled kernels (CUDA kernels for cuda)."""
    if request.param == "ext":
        require_ext(device)
    return request.param


@pytest.fixture
def ext_device(device: str) -> str:
    """A device whose compiled kernels are loaded (for tests of the kernels' exact arithmetic)."""
    require_ext(device)
    return device


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A CPU generator seeded from the test id: every test (and parametrisation) draws its own
    fresh data, and a failure reproduces when the test is run alone."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def one_cpu_thread():
    """One torch CPU thread for the test. The float64 oracles issue thousands of small ops, and on a
    busy 2-core machine each op of a 2-thread pool waits on an OpenMP barrier (100x slower). The
    kernels' own threading is tested explicitly with _oracle.cpu_threads."""
    with cpu_threads(1):
        yield


@pytest.fixture(scope="session")
def emulators(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The host emulation of the CUDA kernels (tests/emulation), one library per metadata variant,
    built once per session for every emulation test file (their marks skip where it cannot build)."""
    from _emulation import build_emulators

    return build_emulators(tmp_path_factory.mktemp("emulation"))


@pytest.fixture
def emu(emulators: dict) -> object:
    """The 32 KB-metadata emulation library (an Emulator)."""
    return emulators["param32k"]
