"""The binding reads contiguity and numel from a tensor's sizes and strides itself (csrc/stable.cpp), not
through torch: it must accept exactly what torch's is_contiguous (and, for the single-list ops,
is_non_overlapping_and_dense) accepts, corner cases included, and process every element of what it accepts."""

from __future__ import annotations

import pytest
import torch
from _devices import require_ext
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense

# (sizes, strides) of views into a large enough buffer.
LAYOUTS = {
    "size1-odd-stride": ((3, 1, 4), (4, 99, 1)),
    "size1-leading": ((1, 5), (7, 1)),
    "size1-trailing": ((4, 1), (1, 1)),
    "all-size1": ((1, 1, 1), (5, 9, 3)),
    "empty-odd-strides": ((0, 3), (1, 7)),
    "empty-middle": ((2, 0, 3), (11, 5, 2)),
    "scalar": ((), ()),
    "contiguous-2d": ((3, 5), (5, 1)),
    "transposed": ((5, 3), (1, 5)),
    "every-other": ((6,), (2,)),
    "expanded": ((4, 3), (0, 1)),
    "overlapping": ((3, 4), (2, 1)),
    "channels-last": ((2, 3, 2, 2), (12, 1, 6, 3)),
    "gap-between-rows": ((3, 4), (5, 1)),
}


def view(device: str, gen: torch.Generator, sizes: tuple, strides: tuple) -> torch.Tensor:
    base = torch.randn(64, generator=gen).to(device)
    return base.as_strided(sizes, strides, storage_offset=1)  # unaligned too


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_paired_ops_take_exactly_what_torch_calls_contiguous(device, gen, layout):
    require_ext(device)
    t = view(device, gen, *LAYOUTS[layout])
    before = t.clone()
    inv_scale, found_inf = torch.full((1,), 2.0, device=device), torch.zeros(1, device=device)
    if not t.is_contiguous():
        with pytest.raises(RuntimeError, match=r"tensors\[0\] is not contiguous"):
            torch.ops.gradacc.unscale_([t], inv_scale, found_inf)
        torch.testing.assert_close(t, before, rtol=0, atol=0)
        return
    torch.ops.gradacc.unscale_([t], inv_scale, found_inf)
    torch.testing.assert_close(t, before * 2, rtol=0, atol=0)  # every element, none beyond
    grads = torch.randn(t.shape, generator=gen).to(device)
    torch.ops.gradacc.accumulate_([t], [grads], 1.0, None, False)
    torch.testing.assert_close(t, before * 2 + grads, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_single_list_ops_take_exactly_what_torch_calls_dense(device, gen, layout):
    require_ext(device)
    t = view(device, gen, *LAYOUTS[layout])
    before = t.clone()
    if not (t.is_contiguous() or is_non_overlapping_and_dense(t)):
        with pytest.raises(RuntimeError, match=r"tensors\[0\] is not dense"):
            torch.ops.gradacc.clip_by_value_([t], 0.5)
        torch.testing.assert_close(t, before, rtol=0, atol=0)
        return
    torch.ops.gradacc.clip_by_value_([t], 0.5)
    torch.testing.assert_close(t, before.clamp(-0.5, 0.5), rtol=0, atol=0)
