"""The window's norm, gathered by its last fold: each bucket adds its partial as it folds.

In one process the sums are final when the window's last micro-step folds its gradients into them, so
that fold can measure them as it writes them (ops.accumulate_final_: the add, the found-inf flag and a
partial norm in one pass over memory) and the window end need not read every buffer again:

    norm(sums) = sqrt(sum of the buckets' sums of squares + |rest|^2)   (norm type 2)
               = max(the buckets' max |x|, |rest|_inf)                   (inf)

where `rest` are the views that hold this window's sum but that the last fold did not write (a
parameter with no gradient in the last micro-step, a grad view that autograd adds into, a fused
Linear's GEMM write): only those take a norm pass. The partials describe the sums as stored (scaled);
the window end multiplies the norm by inv_scale once (the norm of the unscaled sum is the scaled norm
times inv_scale).

FoldNorm is the last micro-step's record, owned by WindowSums (window_sums.py) with the rest of that
micro-step's state, so a failed and rolled-back last micro-step drops its partials with its writes.
A view written twice within the micro-step after its partial was taken (a second backward with
retain_graph, a fused Linear writing a view the hooks already folded) makes the partials stale:
`stale` sends the window end back to the full pass, never to a wrong norm.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

FOLD_NORM_TYPES = (2.0, math.inf)  # the orders whose partials add up across buckets


class FoldNorm:
    """The last micro-step's partial norm (sum of squares, or max |x|) and found-inf flag, as device scalars."""

    def __init__(self, norm_type: float, device: torch.device) -> None:
        if norm_type not in FOLD_NORM_TYPES:
            raise ValueError(f"FoldNorm: norm_type must be 2.0 or inf, got {norm_type}")
        self.norm_type = norm_type
        self.partial = torch.zeros((), dtype=torch.float32, device=device)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self.folded: set[int] = set()  # the views whose stored value the partial describes
        self.stale = False

    def folding(self, index: Iterable[int]) -> None:
        """Views `index` are about to be folded with a partial: a view folded twice makes the first one stale."""
        for i in index:
            if i in self.folded:
                self.stale = True
            self.folded.add(i)

    def rewritten(self, i: int) -> None:
        """View i is written outside the fold: a partial taken of it before no longer describes it."""
        if i in self.folded:
            self.stale = True

    def norm(self, rest_norm: torch.Tensor | None) -> torch.Tensor:
        """The norm of the folded views and of the rest (`rest_norm`: their norm, None when there are none)."""
        if rest_norm is None:
            return self.partial.sqrt() if self.norm_type == 2.0 else self.partial.clone()
        rest = rest_norm.reshape(()).to(torch.float32)
        if self.norm_type == 2.0:  # squared back in float64: the rest's norm carries no more rounding than before
            return (self.partial.double() + rest.double().square()).sqrt().to(torch.float32)
        return torch.maximum(self.partial, rest)  # NaN propagates, like the norm kernels
