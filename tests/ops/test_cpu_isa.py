"""The CPU kernels' ISA variants (csrc/cpu/isa.h).

The op tests check the variant this CPU picks against the float64 oracle; here every variant the CPU can run
must give exactly the bits of the baseline (the fused optimizer steps included), on sizes that hit every vector
tail, unaligned views, subnormals, overflow to Inf and NaN payloads. The binary must keep AVX code inside the
variants and contain no FMA.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator

import pytest
import torch
from _optim_inputs import make_inputs
from _oracle import DTYPES, name

from gradacc_ext import ops
from gradacc_ext.ops._loader import _C

pytestmark = pytest.mark.skipif(_C is None, reason="the compiled extension is not loaded")

# Every vector tail (lanes of 16, blocks of 64), a chunk boundary, and one unaligned view (marked negative).
SIZES = (1, 15, 16, 17, 63, 64, 65, 1000, 65536 + 77, -129)
# Bit patterns per dtype: +-Inf, quiet NaN, signalling NaN, NaNs with payloads, subnormals, the largest finite.
SPECIALS = {
    torch.float16: (0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE37, 0x0001, 0x83FF, 0x7BFF),
    torch.bfloat16: (0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFA5, 0x0001, 0x807F, 0x7F7F),
    torch.float32: (0x7F800000, -0x00800000, 0x7FC00000, 0x7F800001, -0x005A0000, 0x00000001, -0x7F800001, 0x7F7FFFFF),
}
BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}
FINITE_SPECIALS = 3  # the last three of SPECIALS are finite


@pytest.fixture
def isas() -> Iterator[list[str]]:
    """The variants this CPU runs, baseline first; the active one is restored afterwards."""
    compiled = _C.compiled_info()["cpu_isas"]
    usable = compiled[: compiled.index(_C.supported_cpu_isa()) + 1]
    before = _C.cpu_isa()
    yield usable
    _C.set_cpu_isa(before)


def tensors(dtype: torch.dtype, gen: torch.Generator, *, specials: bool) -> list[torch.Tensor]:
    """Normal data of widely spread magnitude, one in 50 elements replaced by a special bit pattern."""
    out = []
    for size in SIZES:
        n = abs(size)
        values = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 14, (n,), generator=gen).float())
        t = values.to(dtype)
        patterns = torch.tensor(SPECIALS[dtype] if specials else SPECIALS[dtype][-FINITE_SPECIALS:])
        where = torch.rand(n, generator=gen) < 0.02
        pick = patterns[torch.randint(len(patterns), (n,), generator=gen)].to(BITS[dtype])
        t.view(BITS[dtype])[where] = pick[where]
        if size < 0:
            t = torch.empty(n + 1, dtype=dtype)[1:].copy_(t)
        out.append(t)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns. fp16 results are compared NaNs included (the element math writes one NaN pattern,
    and F16C must match it); elsewhere any NaN matches any NaN (an add of two NaNs may return either)."""
    if a.dtype == torch.float16:
        return torch.equal(a.view(torch.int16), b.view(torch.int16))
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    bits = BITS[a.dtype]
    return torch.equal(a.reshape(-1).view(bits)[~nan.reshape(-1)], b.reshape(-1).view(bits)[~nan.reshape(-1)])


def check_variants(isas: list[str], inputs: list[list[torch.Tensor]], op: Callable[..., list[torch.Tensor]]) -> None:
    """Runs op on fresh copies of `inputs` under every variant; all results must match the baseline's bits."""
    results = {}
    for isa in isas:
        _C.set_cpu_isa(isa)
        copies = [
            [t.clone() if t.storage_offset() == 0 else torch.empty_like(t).copy_(t) for t in group] for group in inputs
        ]
        results[isa] = op(*copies)
    base = results[isas[0]]
    for isa in isas[1:]:
        for i, (got, want) in enumerate(zip(results[isa], base, strict=True)):
            assert same_bits(got, want), f"variant {isa} differs from {isas[0]} in output {i}"


def scalar(value: float) -> torch.Tensor:
    return torch.full((1,), value)


@pytest.mark.parametrize("specials", [False, True], ids=["finite", "specials"])
@pytest.mark.parametrize("dtype", DTYPES, ids=name)
@pytest.mark.usefixtures("one_cpu_thread")
def test_accumulate_variants_match(isas: list[str], dtype: torch.dtype, specials: bool, gen: torch.Generator):
    grads = tensors(dtype, gen, specials=specials)
    fp32 = [t.float() * 3 for t in tensors(dtype, gen, specials=specials)]
    low = tensors(dtype, gen, specials=specials)

    def acc(bufs: list[torch.Tensor], g: list[torch.Tensor]) -> list[torch.Tensor]:
        ops.accumulate_(bufs, g, 3.0)  # alpha 3 overflows the largest 16-bit values to Inf
        return bufs

    def final(bufs: list[torch.Tensor], g: list[torch.Tensor]) -> list[torch.Tensor]:
        found, norm = scalar(0.0), scalar(0.0)
        ops.accumulate_final_(bufs, g, found, norm, 0.75)
        found_inf, inf_norm = scalar(0.0), scalar(0.0)
        ops.accumulate_final_(bufs, g, found_inf, inf_norm, 0.75, assign=True, norm_type=float("inf"))
        return [*bufs, found, norm, found_inf, inf_norm]

    for bufs in (fp32, low):
        check_variants(isas, [bufs, grads], acc)
        check_variants(isas, [bufs, grads], final)


@pytest.mark.parametrize("specials", [False, True], ids=["finite", "specials"])
@pytest.mark.parametrize("dtype", DTYPES, ids=name)
@pytest.mark.usefixtures("one_cpu_thread")
def test_norm_and_scale_variants_match(isas: list[str], dtype: torch.dtype, specials: bool, gen: torch.Generator):
    xs = tensors(dtype, gen, specials=specials)

    def norms(x: list[torch.Tensor]) -> list[torch.Tensor]:
        out = [*ops.global_norm(x, per_tensor=True), *ops.global_norm(x, float("inf"), per_tensor=True)]
        return out + [ops.global_norm(x, p) for p in (1.0, 3.0, 0.0, -float("inf"))]

    def unscale(x: list[torch.Tensor]) -> list[torch.Tensor]:
        found = scalar(0.0)
        ops.unscale_(x, scalar(2.0**-9), found)
        return [*x, found]

    def clip(x: list[torch.Tensor]) -> list[torch.Tensor]:
        ops.clip_by_norm_(x, scalar(1e4), 3.0)
        ops.clip_by_value_(x, 0.25)
        return x

    for op in (norms, unscale, clip):
        check_variants(isas, [xs], op)


# (param dtype, mode) of the optimizer steps: fp32 and fp64 round to nearest, 16-bit params in every mode.
STEP_CASES = [(torch.float32, "nearest"), (torch.float64, "nearest")] + [
    (dtype, mode) for dtype in (torch.bfloat16, torch.float16) for mode in ("nearest", "master", "stochastic")
]


@pytest.mark.parametrize("specials", [False, True], ids=["finite", "specials"])
@pytest.mark.parametrize(("dtype", "mode"), STEP_CASES, ids=lambda c: name(c) if isinstance(c, torch.dtype) else c)
@pytest.mark.usefixtures("one_cpu_thread")
def test_optim_step_variants_match(isas: list[str], dtype: torch.dtype, mode: str, specials: bool, gen):
    """adamw_step_ (with and without amsgrad), sgd_step_ (plain, and momentum with nesterov and decay) and
    lion_step_ (with decay, and maximize with other betas)."""
    x = make_inputs([abs(s) for s in SIZES], dtype, "cpu", gen, amsgrad=True, masters=mode == "master")
    # Grads of widely spread magnitude, specials included; 16-bit params get fp32 grads, one unaligned.
    x.grads = tensors(torch.float32 if dtype == torch.float64 else dtype, gen, specials=specials)
    x.grads = [g.to(torch.float64) if dtype == torch.float64 else g for g in x.grads]
    if dtype in (torch.bfloat16, torch.float16):
        x.grads[1::2] = [g.float() for g in x.grads[1::2]]
    seed = int(torch.randint(1 << 62, (1,), generator=gen))

    def adamw(params, grads, m, v, vmax, masters, steps) -> list[torch.Tensor]:
        common = dict(weight_decay=0.1, master_params=masters, mode=mode, seed=seed)
        ops.adamw_step_(params, grads, m, v, steps, lr=1e-2, **common)
        ops.adamw_step_(params, grads, m, v, steps, lr=scalar(3e-3), max_exp_avg_sqs=vmax, maximize=True, **common)
        return [*params, *m, *v, *vmax, *masters, *steps]

    def sgd(params, grads, buf, _v, _vmax, masters, steps) -> list[torch.Tensor]:
        common = dict(steps=steps, master_params=masters, mode=mode, seed=seed)
        ops.sgd_step_(params, grads, lr=0.5, **common)
        ops.sgd_step_(params, grads, lr=scalar(0.25), momentum=0.9, weight_decay=0.01, nesterov=True,
                      momentum_buffers=buf, grad_mult=scalar(0.5), **common)  # fmt: skip
        ops.sgd_step_(params, grads, lr=0.1, momentum=0.8, dampening=0.3, momentum_buffers=buf, **common)
        return [*params, *buf, *masters, *steps]

    def lion(params, grads, m, _v, _vmax, masters, steps) -> list[torch.Tensor]:
        common = dict(steps=steps, master_params=masters, mode=mode, seed=seed)
        ops.lion_step_(params, grads, m, lr=1e-2, weight_decay=0.1, **common)
        ops.lion_step_(params, grads, m, lr=scalar(3e-3), betas=(0.5, 0.9), maximize=True, grad_mult=scalar(0.5),
                       **common)  # fmt: skip
        return [*params, *m, *masters, *steps]

    for op in (adamw, sgd, lion):
        check_variants(isas, [*x.lists(), x.steps], op)


def test_isa_choice_and_errors(isas: list[str]):
    compiled = _C.compiled_info()["cpu_isas"]
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    assert compiled[0] == "default" and (compiled == ["default", "avx2", "avx512"] or not x86 or len(compiled) == 1)
    expected = {"AVX512": "avx512", "AVX2": "avx2"}.get(torch.backends.cpu.get_cpu_capability(), "default")
    assert _C.supported_cpu_isa() == (expected if expected in compiled else "default")
    for isa in isas:
        _C.set_cpu_isa(isa)
        assert _C.cpu_isa() == isa
    with pytest.raises(ValueError, match=r"expected one of the compiled variants \(default.*got 'sse9'"):
        _C.set_cpu_isa("sse9")
    unsupported = compiled[len(isas) :]
    for isa in unsupported:
        with pytest.raises(ValueError, match=f"'{isa}' is compiled in but this CPU"):
            _C.set_cpu_isa(isa)
    assert _C.cpu_isa() == isas[-1]


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump is not installed")
def test_binary_keeps_avx_inside_the_variants():
    """Outside the variant namespaces no function may use AVX (so a pre-AVX CPU runs the baseline), and no
    kernel may contain an FMA (the element math forbids contraction in every variant)."""
    path = _C.__file__
    symbols = subprocess.run(["objdump", "-t", path], capture_output=True, text=True, check=True, timeout=60).stdout
    if "SYMBOL TABLE:\nno symbols" in symbols:
        # A stripped release wheel: only exported symbols name functions, so objdump would file every hidden
        # function (the variants' included) under the exported one before it. The unstripped build is checked.
        pytest.skip("the binary is stripped: objdump cannot tell which function an instruction belongs to")
    listing = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", "-C", path], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    avx = re.compile(r"\t(v[a-z0-9]+\s.*%[xyz]mm|.*%[yz]mm|k[a-z]+\s+%k)")
    offenders, fma, function = set(), set(), ""
    for line in listing.splitlines():
        if line.endswith(">:"):
            function = line
        elif "gradacc" in function and re.search(r"\tv?fn?m(add|sub)[0-9]", line):
            fma.add(function)
        elif "isa_avx2::" not in function and "isa_avx512::" not in function and avx.search(line):
            offenders.add(function)
    assert not fma, f"FMA instructions in {sorted(fma)[:5]}"
    assert not offenders, f"AVX instructions outside the variants in {sorted(offenders)[:5]}"


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump is not installed")
def test_binary_runs_parallel_for_on_torchs_pool():
    """The CPU kernels split their loops with torch::stable::parallel_for, which runs them on torch's own
    thread pool inside libtorch (so torch.set_num_threads applies): the binary must call torch_parallel_for."""
    symbols = subprocess.run(["objdump", "-T", _C.__file__], capture_output=True, text=True, check=True, timeout=60)
    assert re.search(r"\btorch_parallel_for\b", symbols.stdout), "the CPU kernels do not use torch's parallel_for"
