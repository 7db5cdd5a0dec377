"""Options of the pytest-benchmark suite (pytest benchmarks/ --benchmark-json ...).

pytest benchmarks/ --benchmark-json benchmarks/results/bench.json --benchmark-min-rounds 3
pytest benchmarks/ --bench-workloads gpt2-small,small-2000 --bench-device cuda --bench-compile
"""

from __future__ import annotations

import pytest

from gradacc_ext.benchmarking import IMPLS, OPERATIONS, default_device, parse_workloads

DEFAULT_WORKLOADS = "gpt2-small=0.125,small-2000=0.25"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gradacc benchmarks")
    group.addoption("--bench-workloads", default=DEFAULT_WORKLOADS, help="name[=scale] list (default: %(default)s)")
    group.addoption("--bench-device", default=None, help="cpu or cuda (default: cuda when available)")
    group.addoption("--bench-compile", action="store_true", help="include torch.compile (slow to compile on a CPU)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "workload" not in metafunc.fixturenames:
        return
    config = metafunc.config
    device = config.getoption("--bench-device") or default_device()
    workloads = parse_workloads(config.getoption("--bench-workloads"))
    workloads = [w for w in workloads if device.startswith("cuda") or not w.gpu_only]
    impls = [i for i in IMPLS if i != "compile" or config.getoption("--bench-compile")]
    metafunc.parametrize("workload", workloads, ids=[f"{w.name}@{w.scale:g}" for w in workloads], scope="module")
    metafunc.parametrize("op_key", list(OPERATIONS))
    metafunc.parametrize("impl", impls)


@pytest.fixture(scope="session")
def bench_device(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--bench-device") or default_device()
