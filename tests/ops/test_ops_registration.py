"""The ops as registered with torch: opcheck, torch.compile, build info, backend choice and the loader."""

from __future__ import annotations

import importlib.util
import math
import time
from types import ModuleType

import pytest
import torch
from _oracle import assert_bitwise_equal, rand, rand_list

import gradacc_ext
from gradacc_ext.ops import _loader

needs_ext = pytest.mark.skipif(
    not gradacc_ext.extension_loaded(), reason=f"extension not loaded: {_loader.LOAD_REASON}"
)
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


# ---- opcheck ----------------------------------------------------------------------------------


def op_samples(device: str, gen: torch.Generator) -> dict[str, list[tuple]]:
    """Representative arguments of every torch.ops.gradacc op (mixed dtypes where the op allows them)."""

    def lists():
        bufs = rand_list([7, 65537, 3, 0], [F32, F16, F32, BF16], device, gen)
        grads = rand_list([7, 65537, 3, 0], [F32, F16, BF16, BF16], device, gen)
        return bufs, grads

    def scalar(value: float, shape: tuple[int, ...] = ()) -> torch.Tensor:
        return torch.full(shape, value, device=device)

    def mixed():
        return rand_list([7, 1000, 65537], [BF16, F32, F16], device, gen)

    def permuted():  # a channels_last tensor among contiguous ones: the norm and clip ops take it in place
        out = mixed()
        out[1] = rand((2, 5, 4, 3), F32, device, gen).to(memory_format=torch.channels_last)
        return out

    return {
        "accumulate_": [(*lists(), 0.5, scalar(2.0), False), (*lists(), 1.5, None, True)],
        "accumulate_final_": [
            (*lists(), 0.5, scalar(2.0, (1,)), False, scalar(0.0, (1,)), scalar(0.5), 2.0),
            (*lists(), 1.0, None, True, scalar(1.0), scalar(0.0), math.inf),
        ],
        "global_norm": [(mixed(), 2.0, True), (mixed(), math.inf, False), (permuted(), 3.0, True)],
        "unscale_": [(mixed(), scalar(0.125), scalar(0.0, (1,)))],
        "clip_by_norm_": [
            (mixed(), scalar(40.0), 1.0, 1e-6),
            (mixed(), scalar(1e-3), 1.0, 1e-6),
            (permuted(), scalar(40.0).to(F16), 0.0, 1e-6),
        ],
        "clip_by_value_": [(mixed(), 0.5), (permuted(), -0.25)],
    }


OP_NAMES = ["accumulate_", "accumulate_final_", "global_norm", "unscale_", "clip_by_norm_", "clip_by_value_"]


# the arguments each op writes, as its schema must declare them (Tensor(a!))
WRITES = {
    "accumulate_": {"bufs"},
    "accumulate_final_": {"bufs", "found_inf", "norm_acc"},
    "global_norm": set(),
    "unscale_": {"tensors", "found_inf"},
    "clip_by_norm_": {"tensors"},
    "clip_by_value_": {"tensors"},
}


@needs_ext
@pytest.mark.parametrize("op", OP_NAMES)
def test_op_is_registered(op):
    schema = getattr(torch.ops.gradacc, op).default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == WRITES[op]
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"gradacc::{op}", "CPU")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"gradacc::{op}", "Meta")  # the fake, for compile
    cuda = torch._C._dispatch_has_kernel_for_dispatch_key(f"gradacc::{op}", "CUDA")
    assert cuda == gradacc_ext.extension_has_cuda()


@needs_ext
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inside opcheck
@pytest.mark.parametrize("op", OP_NAMES)
def test_opcheck(ext_device, gen, op):
    """Schema (mutation annotations), autograd registration, fake kernels and AOT dispatch agree
    with the real kernels."""
    for args in op_samples(ext_device, gen)[op]:
        torch.library.opcheck(getattr(torch.ops.gradacc, op).default, args)


# ---- torch.compile ----------------------------------------------------------------------------


def training_step(bufs, grads, last_grads, found_inf, norm_acc):
    """A window's last two micro-steps through the public API, then clipping."""
    gradacc_ext.accumulate_(bufs, grads, 0.5)
    gradacc_ext.accumulate_final_(bufs, last_grads, found_inf, norm_acc, 0.5)
    total, each = gradacc_ext.global_norm(bufs, per_tensor=True)
    gradacc_ext.clip_by_norm_(bufs, total, 1.0)
    return total, each


@needs_ext
@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_matches_eager(ext_device, gen, compile_backend):
    """fullgraph=True: the Python op layer traces without graph breaks; the compiled step gives
    the eager results bit for bit (the same kernels run)."""
    sizes = [7, 65537, 1000]
    bufs = rand_list(sizes, [F32, F16, F32], ext_device, gen)
    grads = rand_list(sizes, [F32, F16, BF16], ext_device, gen)
    last = rand_list(sizes, [F32, F16, BF16], ext_device, gen)

    def state():
        return [b.clone() for b in bufs], torch.zeros(1, device=ext_device), torch.zeros((), device=ext_device)

    eager_bufs, eager_found, eager_norm = state()
    eager_out = training_step(eager_bufs, grads, last, eager_found, eager_norm)

    torch._dynamo.reset()
    compiled = torch.compile(training_step, fullgraph=True, backend=compile_backend)
    comp_bufs, comp_found, comp_norm = state()
    start = time.perf_counter()
    comp_out = compiled(comp_bufs, grads, last, comp_found, comp_norm)
    print(f"torch.compile({compile_backend}) first call: {time.perf_counter() - start:.2f} s")

    assert eager_out[0] > 1.0, "the step must clip (norm > max_norm), or clip_by_norm_ goes untested"
    for got, want in zip(
        [*comp_out, *comp_bufs, comp_found, comp_norm], [*eager_out, *eager_bufs, eager_found, eager_norm], strict=True
    ):
        assert_bitwise_equal(got, want, what="compiled vs eager")


# ---- build info and backend choice ------------------------------------------------------------


def test_build_info():
    info = gradacc_ext.build_info()
    assert set(info) == {
        "extension_loaded",
        "reason",
        "built_torch_version",
        "built_cuda_version",
        "arch_list",
        "with_cuda",
        "running_torch_version",
        "running_cuda_version",
        "cuda_available",
        "cpu_isas",
        "cpu_isa",
        "abi",
        "min_torch_version",
        "cuda_stream",
    }
    assert info["extension_loaded"] is gradacc_ext.extension_loaded()
    assert info["with_cuda"] is gradacc_ext.extension_has_cuda()
    assert info["running_torch_version"] == torch.__version__
    assert info["running_cuda_version"] == torch.version.cuda
    assert info["cuda_available"] is torch.cuda.is_available()
    assert isinstance(info["reason"], str) and info["reason"]
    if info["extension_loaded"]:
        assert info["reason"] == "compiled extension loaded"
        assert info["abi"] == "stable" and info["min_torch_version"] == "2.11"
        assert info["with_cuda"] == (info["built_cuda_version"] is not None)
        assert info["cpu_isas"][0] == "default" and info["cpu_isa"] in info["cpu_isas"]
        assert (info["cuda_stream"] is None) is not info["with_cuda"]
    else:
        assert info["cpu_isas"] == [] and info["cpu_isa"] is None


@pytest.mark.skipif(not gradacc_ext.extension_has_cuda(), reason="a CPU-only build has no CUDA stream to find")
def test_cuda_build_finds_torchs_current_stream_beside_a_cuda_torch():
    """The CUDA build links no torch CUDA library: it finds aoti_torch_get_current_cuda_stream in the
    libtorch_cuda.so that a CUDA torch has loaded, and says why not beside a CPU torch (where it still loads).
    Runs without a GPU: the lookup needs only the library, so a CUDA torch on a CPU machine checks it."""
    stream = gradacc_ext.build_info()["cuda_stream"]
    if torch.version.cuda is not None:
        assert stream == "ok"
    else:
        assert "libtorch_cuda.so is not loaded" in stream and "CPU-only torch" in stream


@needs_ext
def test_resolve_backend_on_cpu():
    assert gradacc_ext.resolve_backend("cpu") == ("ext", "C++ CPU kernels")
    assert gradacc_ext.resolve_backend(torch.device("cpu"), "ext")[0] == "ext"
    assert gradacc_ext.resolve_backend("cpu", "torch") == ("torch", "backend='torch' was requested")


def test_resolve_backend_without_kernels_for_the_device():
    chosen, reason = gradacc_ext.resolve_backend("meta")
    assert chosen == "torch" and "pure-PyTorch reference" in reason
    with pytest.raises(RuntimeError, match=r"backend='ext' requested for meta tensors, but .*'meta'"):
        gradacc_ext.resolve_backend("meta", "ext")


@pytest.mark.skipif(gradacc_ext.extension_has_cuda(), reason="the extension has CUDA kernels")
def test_resolve_backend_cuda_without_cuda_kernels():
    """A CPU-only build: CUDA tensors fall back to the reference, and 'ext' says why it cannot."""
    assert gradacc_ext.resolve_backend("cuda")[0] == "torch"
    with pytest.raises(RuntimeError, match=r"backend='ext' requested for cuda"):
        gradacc_ext.resolve_backend("cuda", "ext")


def test_resolve_backend_rejects_unknown_names():
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'ext', 'torch'\), got 'fused'"):
        gradacc_ext.resolve_backend("cpu", "fused")


def test_auto_backend_runs_the_kernels_and_agrees_with_ext(gen):
    """backend='auto' on CPU is the compiled path when loaded: bitwise the same as 'ext'."""
    tensors = [rand(70001, F16, "cpu", gen), rand(5, BF16, "cpu", gen)]
    auto = gradacc_ext.global_norm(tensors)
    chosen, _ = gradacc_ext.resolve_backend("cpu")
    assert_bitwise_equal(auto, gradacc_ext.global_norm(tensors, backend=chosen), what="auto vs resolved backend")


# ---- the loader -------------------------------------------------------------------------------


def fake_config(torch_version: str | None, extension: bool = True, min_torch: str = "2.11") -> dict:
    return {
        "extension": extension,
        "torch_version": torch_version,
        "cuda_version": None,
        "arch_list": None,
        "abi": "stable",
        "min_torch_version": min_torch,
    }


def test_loader_reports_a_torch_older_than_the_stable_abi_minimum(monkeypatch):
    monkeypatch.setattr(_loader, "_recorded_config", lambda: fake_config("2.13.0", min_torch="99.1"))
    module, config, reason = _loader._load()  # must not raise
    assert module is None and config["min_torch_version"] == "99.1"
    running = _loader.running_torch_version()
    assert f"uses the LibTorch stable ABI of torch >= 99.1 but torch {running} is running" in reason


@needs_ext
def test_loader_loads_a_build_of_another_torch(monkeypatch):
    """The stable ABI: a binary built against another torch (2.11 or later) loads as it is."""
    monkeypatch.setattr(_loader, "_recorded_config", lambda: fake_config("1.99.0"))
    module, _, reason = _loader._load()
    assert module is not None and reason == "compiled extension loaded"


def test_loader_reports_the_other_reasons(monkeypatch):
    monkeypatch.setattr(_loader, "_recorded_config", lambda: None)
    assert _loader._load()[0] is None and "was not built" in _loader._load()[2]
    monkeypatch.setattr(_loader, "_recorded_config", lambda: fake_config(None, extension=False))
    assert "installed without its extension" in _loader._load()[2]
    monkeypatch.setenv(_loader.DISABLE_ENV, "1")
    assert _loader._load()[0] is None and "GRADACC_NO_EXT=1 is set" in _loader._load()[2]


def load_loader_copy() -> ModuleType:
    """Runs _loader.py's import-time logic again, as a separate module: the real one is untouched."""
    spec = importlib.util.spec_from_file_location("gradacc_ext.ops._loader_probe", _loader.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_require_ext_with_the_extension_disabled_fails_the_import(monkeypatch):
    monkeypatch.setenv(_loader.REQUIRE_ENV, "1")
    monkeypatch.setenv(_loader.DISABLE_ENV, "1")
    with pytest.raises(ImportError, match=r"GRADACC_REQUIRE_EXT=1 but GRADACC_NO_EXT=1 is set"):
        load_loader_copy()


built_with_ext = pytest.mark.skipif(
    not (_loader.BUILD_CONFIG or {}).get("extension"), reason="gradacc_ext was installed without its extension"
)


@built_with_ext
@pytest.mark.parametrize("require", [False, True], ids=["warn", "require"])
def test_torch_mismatch_at_import_warns_or_fails(monkeypatch, require):
    """A torch older than the stable ABI the binary needs: a clear warning naming both versions and the
    reference fallback, or with GRADACC_REQUIRE_EXT=1 an ImportError saying the same."""
    monkeypatch.setattr(torch, "__version__", "2.10.0+cpu")
    monkeypatch.delenv(_loader.DISABLE_ENV, raising=False)
    minimum = _loader.BUILD_CONFIG["min_torch_version"]
    pattern = rf"stable ABI of torch >= {minimum} but torch 2\.10\.0 is running"
    if require:
        monkeypatch.setenv(_loader.REQUIRE_ENV, "1")
        with pytest.raises(ImportError, match=pattern):
            load_loader_copy()
    else:
        monkeypatch.delenv(_loader.REQUIRE_ENV, raising=False)
        with pytest.warns(RuntimeWarning, match=pattern + r".*falling back to the pure-PyTorch reference"):
            probe = load_loader_copy()
        assert not probe.extension_loaded() and probe.build_info()["extension_loaded"] is False


@needs_ext
def test_require_ext_with_a_working_build_loads(monkeypatch):
    monkeypatch.setenv(_loader.REQUIRE_ENV, "1")
    monkeypatch.delenv(_loader.DISABLE_ENV, raising=False)
    assert load_loader_copy().extension_loaded()
