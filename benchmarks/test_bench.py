"""pytest-benchmark view of the harness cells: one test per workload x operation x implementation.

Each implementation is first checked against the reference on the same
inputs (as in compare.py), then timed by pytest-benchmark (wall clock; on
CUDA each call ends with a synchronize). GB/s from the byte model is stored
in extra_info. benchmarks/compare.py is the side-by-side run with
device-event timing, copy bandwidth, launches and targets.
"""

from __future__ import annotations

import itertools

import torch

from gradacc_ext.benchmarking import OPERATIONS, Workload
from gradacc_ext.benchmarking.impls import build_impl
from gradacc_ext.benchmarking.runner import verify_impls
from gradacc_ext.benchmarking.state import make_state
from gradacc_ext.benchmarking.timing import sets_needed, synchronize
from gradacc_ext.benchmarking.verify import RTOL


def test_cell(benchmark, bench_device: str, workload: Workload, op_key: str, impl: str) -> None:
    device, op = torch.device(bench_device), OPERATIONS[op_key]
    n_sets = sets_needed(op.bytes_moved(workload.numel), device)
    states = [make_state(workload, op, device, seed=k) for k in range(n_sets)]
    fn = build_impl(impl, op)
    error = verify_impls({impl: fn}, op, states[0], device)[impl]["error"]
    assert error <= RTOL, f"{impl} computes something else than the reference (rel. error {error:.3g})"

    rotation = itertools.count()

    def call() -> None:
        fn(states[next(rotation) % n_sets])
        synchronize(device)

    benchmark.group = f"{workload.name}@{workload.scale:g} {op_key}"
    benchmark(call)
    median = benchmark.stats.stats.median
    bytes_moved = op.bytes_moved(workload.numel)
    benchmark.extra_info.update(
        workload=workload.summary(), bytes=bytes_moved, gbps=bytes_moved / median / 1e9, n_sets=n_sets,
        device=str(device),
    )  # fmt: skip
