"""Runtime GPU coverage: the decision (mocked device facts, runs anywhere), its routing and one-time
warning, `gradacc info`'s per-GPU report, and on a GPU the fallback path against the fused one."""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import pytest
import torch
from _devices import CUDA_SKIP, require_ext
from _oracle import assert_close_list, f64, rand_list

import gradacc_ext
from gradacc_ext.cli import envinfo
from gradacc_ext.ops import api
from gradacc_ext.ops import coverage as gpu_coverage

H100 = gpu_coverage.DeviceFacts(
    device="cuda:0", name="mock H100", capability=(9, 0), driver_cuda=(13, 0), built_cuda="13.0",
    arch_list="8.0;9.0+PTX",
)  # fmt: skip


@pytest.mark.parametrize(
    ("change", "covered", "reason"),
    [
        ({}, True, "runs the 9.0 binary"),
        ({"capability": (8, 6)}, True, "runs the 8.0 binary"),  # same major, newer minor
        ({"capability": (10, 0)}, True, "JIT-compiles the 9.0 PTX"),
        ({"capability": (12, 0)}, True, "JIT-compiles the 9.0 PTX"),
        ({"capability": (7, 5)}, False, "TORCH_CUDA_ARCH_LIST including 7.5"),  # T4: older than every binary
        ({"capability": (7, 0)}, False, "TORCH_CUDA_ARCH_LIST including 7.0"),  # V100
        ({"arch_list": "9.0a", "capability": (9, 0)}, True, "runs the 9.0a binary"),
        ({"arch_list": "9.0a", "capability": (10, 0)}, False, "TORCH_CUDA_ARCH_LIST"),  # arch-specific, no PTX
        ({"arch_list": None}, False, "no CUDA kernels"),
        ({"driver_cuda": (12, 0)}, False, "R530"),  # 32 KB parameters on a pre-12.1 driver
        ({"driver_cuda": (12, 1)}, True, "binary"),
        ({"driver_cuda": None}, True, "binary"),  # unknown: the launch itself will tell
        ({"built_cuda": "11.8", "driver_cuda": (11, 4)}, True, "binary"),  # a pre-12.1 build uses 4 KB
    ],
)
def test_decision(change, covered, reason):
    c = gpu_coverage.decide(replace(H100, **change))
    assert c.covered is covered and reason in c.reason, c
    assert c.path == ("fused CUDA kernels" if covered else "pure-PyTorch reference")
    if not covered:
        assert c.reason.startswith("cuda:0 (mock H100)")  # names the device


@pytest.fixture
def mock_gpu(monkeypatch):
    """A CUDA build and one GPU whose facts the test sets: `mock_gpu(facts)`."""
    monkeypatch.setattr(api, "extension_loaded", lambda: True)
    monkeypatch.setattr(api, "extension_has_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    gpu_coverage.forget()

    def use(facts: gpu_coverage.DeviceFacts) -> None:
        monkeypatch.setattr(gpu_coverage, "device_facts", lambda index: replace(facts, device=f"cuda:{index}"))

    yield use
    gpu_coverage.forget()


def test_uncovered_gpu_falls_back_and_warns_once(mock_gpu):
    mock_gpu(replace(H100, capability=(7, 5), name="mock T4"))
    with pytest.warns(RuntimeWarning, match=r"cuda:0 \(mock T4\).*TORCH_CUDA_ARCH_LIST including 7\.5"):
        chosen, reason = gradacc_ext.resolve_backend("cuda:0")
    assert chosen == "torch" and "7.5" in reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second use of the device is silent
        assert gradacc_ext.resolve_backend("cuda")[0] == "torch"
        with pytest.raises(RuntimeError, match=r"backend='ext' requested for cuda.*7\.5"):
            gradacc_ext.resolve_backend("cuda:0", "ext")


def test_old_driver_falls_back_naming_the_fix(mock_gpu):
    mock_gpu(replace(H100, driver_cuda=(12, 0)))
    with pytest.warns(RuntimeWarning, match=r"update the NVIDIA driver"):
        assert gradacc_ext.resolve_backend("cuda:0")[0] == "torch"


def test_covered_gpu_uses_the_fused_kernels_silently(mock_gpu):
    mock_gpu(H100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gradacc_ext.resolve_backend("cuda:0") == ("ext", "fused CUDA kernels")


def test_info_reports_each_gpu_with_its_path(mock_gpu, monkeypatch):
    mock_gpu(replace(H100, capability=(7, 5), name="mock T4"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.warns(RuntimeWarning):
        info = envinfo.collect()
    assert [g["device"] for g in info["gpus"]] == ["cuda:0", "cuda:1"]
    assert all(not g["covered"] and g["path"] == "pure-PyTorch reference" for g in info["gpus"])
    text = envinfo.render(info)
    assert "cuda:1 mock T4, compute 7.5: NOT COVERED, pure-PyTorch reference" in text
    assert all(row["backend"] == "torch" for row in info["backends"]["cuda"].values())


@CUDA_SKIP
def test_fallback_matches_the_fused_kernels_on_cuda(monkeypatch, gen):
    """On a real GPU: force the fallback, run the final micro-step both ways, both within the oracle's
    bounds of the same inputs, and flags equal."""
    require_ext("cuda")
    facts = gpu_coverage.device_facts(torch.cuda.current_device())
    numels = [1, 7, 65537, 300]
    grads = rand_list(numels, [torch.float16, torch.bfloat16, torch.float32, torch.float16], "cuda", gen)
    start = rand_list(numels, torch.float32, "cuda", gen)
    want = [b + 0.5 * g for b, g in zip(f64(start), f64(grads), strict=True)]
    mag = [b.abs() + (0.5 * g).abs() for b, g in zip(f64(start), f64(grads), strict=True)]
    results = {}
    for path, arch_list in (("fused", facts.arch_list), ("fallback", None)):
        monkeypatch.setattr(gpu_coverage, "device_facts", lambda index, a=arch_list: replace(facts, arch_list=a))
        gpu_coverage.forget()
        bufs = [b.clone() for b in start]
        found, norm = torch.zeros(1, device="cuda"), torch.zeros((), device="cuda")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert gradacc_ext.resolve_backend("cuda")[0] == ("ext" if path == "fused" else "torch")
            gradacc_ext.accumulate_final_(bufs, grads, found, norm, 0.5)
        assert_close_list(bufs, want, mag, 3, path)
        results[path] = (found.item(), norm.item())
    gpu_coverage.forget()
    assert results["fused"][0] == results["fallback"][0] == 0.0
    assert math.isclose(results["fused"][1], results["fallback"][1], rel_tol=1e-5)
