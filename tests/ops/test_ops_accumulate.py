"""accumulate_ and accumulate_final_ against the float64 oracle, on both backends and every device.

Also the kernels' exact arithmetic (ext only): fp32 results equal torch's
separate multiply then add bit for bit (no FMA), and every fp16/bf16 bit
pattern converts to and from fp32 exactly as torch does.
"""

from __future__ import annotations

import math

import pytest
import torch
from _oracle import (
    LOW,
    ODD_SIZES,
    assert_bitwise_equal,
    assert_close,
    assert_close_list,
    assert_norm_close,
    cpu_threads,
    f64,
    name,
    rand,
    rand_list,
    random_dtypes,
    small_sizes,
)

import gradacc_ext
from gradacc_ext.ops import reference

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests that need threads ask for them

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (grad dtype, buffer dtype): a buffer is fp32 or its grad's dtype
PAIRS = [(F32, F32), (F16, F32), (F16, F16), (BF16, F32), (BF16, BF16)]
PAIR_IDS = [f"g{name(g)}-b{name(b)}" for g, b in PAIRS]
LAYOUTS = ("odd", "single", "many", "shapes", "unaligned", "empties")
# (assign, scale kind): every layout runs the first two, the "odd" layout all four
MODES = [(False, "float"), (True, "tensor0d"), (False, "tensor1"), (True, "float")]
ACC_CASES = [
    pytest.param(layout, assign, scale, id=f"{layout}-{'assign' if assign else 'add'}-{scale}")
    for layout in LAYOUTS
    for assign, scale in (MODES if layout == "odd" else MODES[:2])
]


def layout_shapes(layout: str, gen: torch.Generator) -> list[tuple[int, ...]]:
    if layout == "odd" or layout == "unaligned":
        return [(n,) for n in ODD_SIZES]
    if layout == "single":
        return [(1,)]
    if layout == "many":
        return [(n,) for n in small_sizes(gen)]
    if layout == "shapes":
        return [(3, 5, 7), (1, 1), (2, 65537), (4, 0, 3), (1,)]
    assert layout == "empties"
    return [(0,), (7,), (0,), (65537,), (0,)]


def make_lists(
    shapes: list[tuple[int, ...]],
    grad_dtypes: list[torch.dtype],
    buf_dtypes: list[torch.dtype],
    device: str,
    gen: torch.Generator,
    unaligned: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    bufs = [rand(s, d, device, gen, unaligned=unaligned) for s, d in zip(shapes, buf_dtypes, strict=True)]
    grads = [rand(s, d, device, gen, unaligned=unaligned) for s, d in zip(shapes, grad_dtypes, strict=True)]
    return bufs, grads


def make_scale(kind: str, device: str, gen: torch.Generator) -> tuple[float | torch.Tensor, float, torch.Tensor | None]:
    """(scale for the public API, alpha, alpha_tensor) for the oracle. A fresh value each call;
    as a Python float it is a double that fp32 cannot represent, so its conversion is exercised."""
    value = 0.1 + 2.0 * torch.rand((), generator=gen, dtype=torch.float64).item()
    if kind == "float":
        return value, value, None
    shape = () if kind == "tensor0d" else (1,)
    t = torch.full(shape, value, dtype=torch.float32, device=device)
    return t, 1.0, t


def magnitude(bufs0: list[torch.Tensor], grads: list[torch.Tensor], alpha: float, assign: bool) -> list[torch.Tensor]:
    """|buf| + |alpha * grad| in float64: the size of the values the kernels round."""
    out = []
    for b, g in zip(f64(bufs0), f64(grads), strict=True):
        m = (g * alpha).abs()
        out.append(m if assign else m + b.abs())
    return out


def effective_alpha(alpha: float, alpha_tensor: torch.Tensor | None) -> float:
    return alpha * (alpha_tensor.item() if alpha_tensor is not None else 1.0)


# ---- accumulate_ ------------------------------------------------------------------------------


@pytest.mark.parametrize(("layout", "assign", "scale_kind"), ACC_CASES)
@pytest.mark.parametrize(("grad_dtype", "buf_dtype"), PAIRS, ids=PAIR_IDS)
def test_accumulate_matches_oracle(device, backend, gen, grad_dtype, buf_dtype, layout, assign, scale_kind):
    shapes = layout_shapes(layout, gen)
    bufs, grads = make_lists(
        shapes, [grad_dtype] * len(shapes), [buf_dtype] * len(shapes), device, gen, unaligned=layout == "unaligned"
    )
    scale, alpha, alpha_tensor = make_scale(scale_kind, device, gen)
    want = f64(bufs)
    reference.accumulate_(want, f64(grads), alpha, alpha_tensor, assign)
    mags = magnitude(bufs, grads, effective_alpha(alpha, alpha_tensor), assign)
    if assign:
        for b in bufs:  # poison: every element must be written
            b.fill_(math.nan)

    gradacc_ext.accumulate_(bufs, grads, scale, assign=assign, backend=backend)

    assert all(b.dtype == buf_dtype for b in bufs)
    # alpha's conversion to fp32, the multiply and the add: three roundings
    assert_close_list(bufs, want, mags, roundings=3, what="bufs")


@pytest.mark.parametrize(("grad_dtype", "buf_dtype"), PAIRS, ids=PAIR_IDS)
def test_accumulate_large_tensor(device, backend, gen, grad_dtype, buf_dtype):
    n = 2_000_003
    bufs, grads = make_lists([(n,)], [grad_dtype], [buf_dtype], device, gen)
    scale, alpha, alpha_tensor = make_scale("tensor0d", device, gen)
    want = f64(bufs)
    reference.accumulate_(want, f64(grads), alpha, alpha_tensor, False)
    mags = magnitude(bufs, grads, effective_alpha(alpha, alpha_tensor), False)
    gradacc_ext.accumulate_(bufs, grads, scale, backend=backend)
    assert_close(bufs[0], want[0], mags[0], roundings=3, what="bufs[0]")


@pytest.mark.parametrize("assign", [False, True], ids=["add", "assign"])
def test_accumulate_mixed_dtype_list(device, backend, gen, assign):
    """One call over fp32/fp16/bf16 grads with fp32 or own-dtype buffers mixed in one list."""
    sizes = [*ODD_SIZES, *small_sizes(gen, count=200)]
    grad_dtypes = random_dtypes(gen, len(sizes))
    own = torch.rand(len(sizes), generator=gen) < 0.5
    buf_dtypes = [g if o else F32 for g, o in zip(grad_dtypes, own.tolist(), strict=True)]
    bufs, grads = make_lists([(n,) for n in sizes], grad_dtypes, buf_dtypes, device, gen)
    scale, alpha, alpha_tensor = make_scale("float", device, gen)
    want = f64(bufs)
    reference.accumulate_(want, f64(grads), alpha, alpha_tensor, assign)
    mags = magnitude(bufs, grads, alpha, assign)
    gradacc_ext.accumulate_(bufs, grads, scale, assign=assign, backend=backend)
    assert_close_list(bufs, want, mags, roundings=3, what="bufs")


def test_accumulate_empty_lists(device, backend):
    gradacc_ext.accumulate_([], [], 0.5, backend=backend)  # nothing to do, no error


def test_accumulate_nonfinite_propagates(device, backend, gen):
    """accumulate_ does no checking of its own: NaN/Inf reach the buffers unchanged."""
    bufs, grads = make_lists([(7,), (65537,)], [BF16, F16], [F32, F16], device, gen)
    grads[0][0], grads[1][-1], bufs[1][3] = math.nan, -math.inf, math.inf
    want = f64(bufs)
    reference.accumulate_(want, f64(grads), 0.5, None, False)
    mags = magnitude(bufs, grads, 0.5, False)
    gradacc_ext.accumulate_(bufs, grads, 0.5, backend=backend)
    assert_close_list(bufs, want, mags, roundings=3, what="bufs")
    assert bufs[0][0].isnan() and bufs[1][-1] == -math.inf and bufs[1][3] == math.inf


@pytest.mark.parametrize("op", ["accumulate_", "accumulate_final_"])
def test_accumulate_is_deterministic(device, backend, gen, op):
    """Three runs from identical inputs agree bit for bit; the kernels' results do not depend on the
    CPU thread count either (the torch backend's sums do, so it is exempt from that part)."""
    sizes = [*ODD_SIZES, 600_001, *small_sizes(gen, count=100)]
    dtypes = random_dtypes(gen, len(sizes))
    bufs0, grads = make_lists([(n,) for n in sizes], dtypes, dtypes, device, gen)

    def run() -> list[torch.Tensor]:
        bufs = [b.clone() for b in bufs0]
        if op == "accumulate_":
            gradacc_ext.accumulate_(bufs, grads, 0.3, backend=backend)
            return bufs
        found, norm = torch.zeros(1, device=device), torch.zeros((), device=device)
        gradacc_ext.accumulate_final_(bufs, grads, found, norm, 0.3, backend=backend)
        return [*bufs, found, norm]

    with cpu_threads(2):
        results = [run() for _ in range(3)]
    if backend == "ext":
        with cpu_threads(1):
            results.append(run())
    for other in results[1:]:
        for i, (a, b) in enumerate(zip(results[0], other, strict=True)):
            assert_bitwise_equal(b, a, what=f"output {i}")


# ---- accumulate_final_ --------------------------------------------------------------------------

# (assign, scale kind, norm_acc's starting value (an earlier bucket's partial), found_inf's starting value)
FINAL_MODES = [
    (False, "float", 0.0, 0.0),
    (True, "tensor0d", 3.0, 0.0),
    (False, "tensor1", 0.0, 1.0),
    (True, "float", 3.0, 1.0),
]
FINAL_MODE_IDS = ["add-float-n0-f0", "assign-t0d-n3-f0", "add-t1-n0-f1", "assign-float-n3-f1"]
L2, LINF = 2.0, math.inf
# (layout, mode index, norm type): "odd" crosses every mode with both norms, the others two cases each
_FINAL = [("odd", m, n) for m in range(4) for n in (L2, LINF)] + [
    ("many", 0, L2), ("many", 3, LINF), ("unaligned", 1, L2), ("unaligned", 2, LINF),
    ("empties", 0, LINF), ("empties", 1, L2),
]  # fmt: skip
FINAL_CASES = [
    pytest.param(layout, *FINAL_MODES[m], n, id=f"{layout}-{FINAL_MODE_IDS[m]}-{'l2' if n == L2 else 'linf'}")
    for layout, m, n in _FINAL
]


def run_final(bufs, grads, scale_kind, assign, norm_start, found_start, norm_type, device, gen, backend):
    """Runs accumulate_final_ and the oracle; returns (want bufs, magnitudes, found_inf, norm_acc)."""
    scale, alpha, alpha_tensor = make_scale(scale_kind, device, gen)
    want = f64(bufs)
    found64, norm64 = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    reference.accumulate_final_(want, f64(grads), alpha, alpha_tensor, assign, found64, norm64, norm_type)
    mags = magnitude(bufs, grads, effective_alpha(alpha, alpha_tensor), assign)
    found = torch.full((1,), found_start, device=device)
    norm_acc = torch.full((), norm_start, device=device)
    if assign:
        for b in bufs:
            b.fill_(math.nan)
    gradacc_ext.accumulate_final_(
        bufs, grads, found, norm_acc, scale, assign=assign, norm_type=norm_type, backend=backend
    )
    return want, mags, found, norm_acc


def partial_norm(norm_acc: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The norm a running partial stands for: sqrt of the sum of squares, or the max itself."""
    return norm_acc.sqrt() if norm_type == L2 else norm_acc


def start_term(norm_start: float, norm_type: float, device: str) -> torch.Tensor:
    """A one-element tensor whose statistic is `norm_start`: the earlier partial, as one more tensor of the list."""
    return torch.full((1,), math.sqrt(norm_start) if norm_type == L2 else norm_start, device=device)


@pytest.mark.parametrize(("layout", "assign", "scale_kind", "norm_start", "found_start", "norm_type"), FINAL_CASES)
@pytest.mark.parametrize(("grad_dtype", "buf_dtype"), PAIRS, ids=PAIR_IDS)
def test_accumulate_final_matches_oracle(
    device, backend, gen, grad_dtype, buf_dtype, layout, assign, scale_kind, norm_start, found_start, norm_type
):
    shapes = layout_shapes(layout, gen)
    bufs, grads = make_lists(
        shapes, [grad_dtype] * len(shapes), [buf_dtype] * len(shapes), device, gen, unaligned=layout == "unaligned"
    )
    want, mags, found, norm_acc = run_final(
        bufs, grads, scale_kind, assign, norm_start, found_start, norm_type, device, gen, backend
    )
    # alpha's conversion, multiply and add: accumulate_'s arithmetic, the results left as stored (scaled)
    assert_close_list(bufs, want, mags, roundings=3, what="bufs")
    assert found.item() == found_start, "found_inf changed although every result is finite"
    # the partial describes what was stored in the buffers, added to the one norm_acc held
    terms = [*bufs, start_term(norm_start, norm_type, device)]
    assert_norm_close(partial_norm(norm_acc, norm_type), terms, norm_type, what="norm_acc")


@pytest.mark.parametrize("norm_type", [L2, LINF], ids=["l2", "linf"])
def test_accumulate_final_buckets_add_up_to_the_whole(device, backend, gen, norm_type):
    """A last fold in three buckets: their partials, added in one norm_acc, are the norm of every view
    (the max exactly: the same maximum, whichever bucket holds it)."""
    sizes = [*ODD_SIZES, *small_sizes(gen, count=30)]
    dtypes = random_dtypes(gen, len(sizes))
    bufs, grads = make_lists([(n,) for n in sizes], dtypes, dtypes, device, gen)
    found, norm_acc = torch.zeros(1, device=device), torch.zeros((), device=device)
    for part in (slice(0, 3), slice(3, 20), slice(20, None)):
        gradacc_ext.accumulate_final_(bufs[part], grads[part], found, norm_acc, 0.7, norm_type=norm_type,
                                      backend=backend)  # fmt: skip
    assert found.item() == 0.0
    assert_norm_close(partial_norm(norm_acc, norm_type), bufs, norm_type, what="norm_acc")
    if norm_type == LINF:
        assert_bitwise_equal(norm_acc, gradacc_ext.global_norm(bufs, LINF, backend=backend), what="max")


def test_accumulate_final_refuses_a_norm_type_without_partials(device, backend, gen):
    """Only the sum of squares and the max add across buckets: another order is refused, nothing written."""
    bufs, grads = make_lists([(5,)], [F32], [F32], device, gen)
    before, found, norm_acc = bufs[0].clone(), torch.zeros(1, device=device), torch.zeros((), device=device)
    with pytest.raises(ValueError, match="norm_type must be 2.0 or inf, got 1"):
        gradacc_ext.accumulate_final_(bufs, grads, found, norm_acc, 1.0, norm_type=1.0, backend=backend)
    assert_bitwise_equal(bufs[0], before, what="bufs")
    assert norm_acc.item() == 0.0


@pytest.mark.parametrize("norm_type", [L2, LINF], ids=["l2", "linf"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(("grad_dtype", "buf_dtype"), [(F32, F32), (F16, F16), (BF16, F32)], ids=str)
def test_accumulate_final_nonfinite(device, backend, gen, grad_dtype, buf_dtype, value, where, norm_type):
    """A NaN/Inf result raises found_inf and makes the norm NaN/Inf, wherever it sits."""
    sizes = [7, 65537, 1000]
    bufs, grads = make_lists([(n,) for n in sizes], [grad_dtype] * 3, [buf_dtype] * 3, device, gen)
    tensor, elem = {"first": (0, 0), "middle": (1, 65536 // 2 + 3), "last": (2, 999)}[where]
    grads[tensor][elem] = value
    want, mags, found, norm_acc = run_final(bufs, grads, "float", False, 0.0, 0.0, norm_type, device, gen, backend)
    assert_close_list(bufs, want, mags, roundings=3, what="bufs")
    assert found.item() == 1.0
    if math.isnan(value):
        assert norm_acc.isnan(), f"norm partial {norm_acc.item()} should be NaN"
    else:
        assert norm_acc.item() == math.inf


@pytest.mark.parametrize("where", ["first_chunk", "last_chunk"])
def test_found_inf_and_norm_on_two_threads(device, backend, gen, where):
    """The chunks run on two CPU threads: a NaN in any chunk still raises found_inf (accumulate_final_
    and unscale_) and reaches the norm, and every finite element still matches the oracle."""
    sizes = [65537] * 6
    tensor, elem = (0, 3) if where == "first_chunk" else (5, 65536)
    with cpu_threads(2):
        bufs, grads = make_lists([(n,) for n in sizes], [BF16, F16] * 3, [F32, F16] * 3, device, gen)
        grads[tensor][elem] = math.nan
        want, mags, found, norm_acc = run_final(bufs, grads, "float", False, 0.0, 0.0, L2, device, gen, backend)
        assert found.item() == 1.0 and norm_acc.isnan()
        assert_close_list(bufs, want, mags, roundings=3, what="bufs")

        tensors = rand_list(sizes, [F32, BF16] * 3, device, gen)
        tensors[tensor][elem] = math.nan
        found = torch.zeros(1, device=device)
        gradacc_ext.unscale_(tensors, torch.full((), 0.5, device=device), found, backend=backend)
        assert found.item() == 1.0


@pytest.mark.parametrize("buf_dtype", [F32, F16], ids=name)
def test_accumulate_final_flags_overflow_of_the_stored_value(device, backend, gen, buf_dtype):
    """A finite grad can overflow the buffer (fp32 sum, or the fp16 store): found_inf must see it."""
    big = 60000.0 if buf_dtype == F16 else 3e38
    bufs, grads = make_lists([(9,), (70000,)], [buf_dtype] * 2, [buf_dtype] * 2, device, gen)
    bufs[1][12345], grads[1][12345] = big, big
    found, norm_acc = torch.zeros(1, device=device), torch.zeros((), device=device)
    gradacc_ext.accumulate_final_(bufs, grads, found, norm_acc, 1.0, backend=backend)
    assert bufs[1][12345].item() == math.inf
    assert found.item() == 1.0 and norm_acc.item() == math.inf


def test_accumulate_final_empty_lists(device, backend):
    """Nothing folded adds nothing: the running partial and the flag keep what they held."""
    found, norm_acc = torch.ones(1, device=device), torch.full((), 2.5, device=device)
    gradacc_ext.accumulate_final_([], [], found, norm_acc, 0.5, backend=backend)
    assert found.item() == 1.0 and norm_acc.item() == 2.5


# ---- exact arithmetic of the compiled kernels ----------------------------------------------------


@pytest.mark.parametrize("grad_dtype", [F32, F16, BF16], ids=name)
def test_fp32_buffers_match_separate_multiply_and_add(ext_device, gen, grad_dtype):
    """fp32 buffers: buf + (alpha * grad) rounded after the multiply and after the add, as torch does
    with two separate ops; an FMA would differ in the last bit for a large share of random inputs."""
    sizes = [*ODD_SIZES, 1_000_001]
    bufs, grads = make_lists([(n,) for n in sizes], [grad_dtype] * len(sizes), [F32] * len(sizes), ext_device, gen)
    alpha = 0.1 + torch.rand((), generator=gen, dtype=torch.float64).item()
    alpha_t = torch.rand((), generator=gen).to(ext_device) + 0.5
    alpha32 = torch.tensor(alpha, dtype=F32, device=ext_device)
    # alpha and alpha_tensor both given (only reachable through the raw op): alpha32 * alpha_t, then as above
    expected = [
        torch.add(b, torch.mul(torch.mul(alpha32, alpha_t), g.float())) for b, g in zip(bufs, grads, strict=True)
    ]
    torch.ops.gradacc.accumulate_(bufs, grads, alpha, alpha_t, False)
    for i, (b, e) in enumerate(zip(bufs, expected, strict=True)):
        assert_bitwise_equal(b, e, what=f"bufs[{i}]")

    bufs, grads = make_lists([(n,) for n in sizes], [grad_dtype] * len(sizes), [F32] * len(sizes), ext_device, gen)
    expected = [torch.add(b, torch.mul(alpha32, g.float())) for b, g in zip(bufs, grads, strict=True)]
    found, norm_acc = torch.zeros(1, device=ext_device), torch.zeros((), device=ext_device)
    gradacc_ext.accumulate_final_(bufs, grads, found, norm_acc, alpha, backend="ext")
    for i, (b, e) in enumerate(zip(bufs, expected, strict=True)):
        assert_bitwise_equal(b, e, what=f"final bufs[{i}]")


def all_bit_patterns(dtype: torch.dtype, device: str) -> torch.Tensor:
    """Every one of the 65,536 values of a 16-bit float type (NaNs and subnormals included)."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).to(device)


@pytest.mark.parametrize("dtype", LOW, ids=name)
def test_16bit_to_fp32_conversion_is_exact_for_every_bit_pattern(ext_device, dtype):
    grads = all_bit_patterns(dtype, ext_device)
    bufs = torch.full(grads.shape, math.nan, device=ext_device)  # poison
    gradacc_ext.accumulate_([bufs], [grads], 1.0, assign=True, backend="ext")
    assert_bitwise_equal(bufs, grads.float(), what=f"{name(dtype)} -> float32")


# alpha values probing the store: generic, exact ties (x * (1 + 2^-(p+1)) lies halfway between two
# neighbours for every normal x with p mantissa bits), overflow near the top, and subnormal results.
ROUND_ALPHAS = {"generic": 0.3, "ties": None, "overflow": 1.003, "subnormal": 3e-4}


@pytest.mark.parametrize("op", ["accumulate_", "accumulate_final_"])
@pytest.mark.parametrize("assign", [False, True], ids=["add", "assign"])
@pytest.mark.parametrize("alpha_kind", list(ROUND_ALPHAS))
@pytest.mark.parametrize("dtype", LOW, ids=name)
def test_fp32_to_16bit_rounding_matches_torch_for_every_bit_pattern(ext_device, gen, dtype, alpha_kind, assign, op):
    """16-bit buffers: the fp32 result is rounded to nearest even, overflows to Inf and rounds into the
    subnormals exactly like torch's .to(dtype), for all 65,536 grads (and shuffled buffers)."""
    alpha = ROUND_ALPHAS[alpha_kind]
    if alpha is None:
        alpha = 1.0 + 2.0 ** -(11 if dtype == F16 else 8)
    grads = all_bit_patterns(dtype, ext_device)
    bufs = grads[torch.randperm(grads.numel(), generator=gen).to(ext_device)].clone()
    alpha32 = torch.tensor(alpha, dtype=F32, device=ext_device)
    value = torch.mul(alpha32, grads.float())
    if not assign:
        value = torch.add(bufs.float(), value)
    if op == "accumulate_":
        gradacc_ext.accumulate_([bufs], [grads], alpha, assign=assign, backend="ext")
    else:
        found, norm_acc = torch.zeros(1, device=ext_device), torch.zeros((), device=ext_device)
        gradacc_ext.accumulate_final_([bufs], [grads], found, norm_acc, alpha, assign=assign, backend="ext")
        assert found.item() == 1.0  # the patterns include NaN and Inf
    assert_bitwise_equal(bufs, value.to(dtype), what=f"float32 -> {name(dtype)}")
