"""The open window's normalisation state: micro-steps taken and the normaliser they add up to.

The buffers hold a SUM of weighted micro-step gradients; the window's
normaliser is the micro-batch count ("mean" mode), or the item count
("mean" with num_items, or "sum"). It is kept in two parts so that nothing is
read on the host: Python numbers for int counts, a device tensor for tensor
counts.
"""

from __future__ import annotations

from typing import Any

import torch


class Window:
    """Micro-step count and normaliser of the open window, and the weight of each micro-step."""

    def __init__(self, loss_normalization: str, device: torch.device) -> None:
        self.mode = loss_normalization
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.micro = 0  # micro-steps accumulated in the open window
        self.count_host = 0.0  # the window's normaliser, host part (ints)
        self.count_dev: torch.Tensor | None = None  # ... and device part (tensor item counts)
        self.weighted: bool | None = None  # mean mode: were num_items given in this window?

    def weight(
        self, num_items: int | torch.Tensor | None, share: float = 1.0
    ) -> tuple[float | torch.Tensor, float | torch.Tensor]:
        """(weight of this micro-step's gradient, its contribution to the window's normaliser).

        share: the part of its micro-batch that this backward covers (the adaptive accumulator's splits):
        without num_items, a mean loss over the part stands for `share` of the micro-batch's mean.
        """
        weight, count = self._weight(num_items)
        return (share, share) if num_items is None and share != 1.0 else (weight, count)

    def _weight(self, num_items: int | torch.Tensor | None) -> tuple[float | torch.Tensor, float | torch.Tensor]:
        if self.mode == "none":
            if num_items is not None:
                raise ValueError(
                    "GradientAccumulator.backward: num_items cannot be given with loss_normalization='none' (the "
                    "losses are already divided by the caller and nothing is divided again)"
                )
            return 1.0, 1.0
        if num_items is None:
            if self.mode == "sum":
                raise ValueError(
                    "GradientAccumulator.backward: num_items is required with loss_normalization='sum' "
                    "(the loss is a sum over items and the window is divided by their total)"
                )
            if self.weighted:
                raise ValueError(
                    "GradientAccumulator.backward: num_items must be given for every micro-batch of a "
                    "window or for none (it was given earlier in this window)"
                )
            return 1.0, 1.0
        if self.weighted is False:
            raise ValueError(
                "GradientAccumulator.backward: num_items must be given for every micro-batch of a "
                "window or for none (it was omitted earlier in this window)"
            )
        if isinstance(num_items, torch.Tensor):
            if num_items.numel() != 1 or num_items.is_complex() or num_items.dtype == torch.bool:
                raise ValueError(
                    f"GradientAccumulator.backward: num_items must be an int or a one-element real tensor, "
                    f"got shape {list(num_items.shape)} dtype {num_items.dtype}"
                )
            count = num_items.detach().to(self.device).reshape(1)
            weight = count.to(torch.float32) if self.mode == "mean" else 1.0
            return weight, count
        if isinstance(num_items, bool) or not isinstance(num_items, int) or num_items < 0:
            raise ValueError(
                f"GradientAccumulator.backward: num_items must be an int >= 0 or a tensor, got {num_items!r}"
            )
        return (float(num_items) if self.mode == "mean" else 1.0), float(num_items)

    def commit(self, weighted: bool, count: float | torch.Tensor, completes_micro_batch: bool) -> None:
        """Adds a finished backward's share of the normaliser; counts the micro-step it completes."""
        if completes_micro_batch:
            self.micro += 1
        if self.mode == "mean":
            self.weighted = weighted
        if isinstance(count, torch.Tensor):
            count = count.to(torch.float64)
            self.count_dev = count if self.count_dev is None else self.count_dev + count
        else:
            self.count_host += count

    def count(self) -> torch.Tensor:
        """The window's normaliser as a float64 device tensor of shape (1,) (1 in "none" mode)."""
        count = torch.full(
            (1,), 1.0 if self.mode == "none" else self.count_host, dtype=torch.float64, device=self.device
        )
        return count if self.count_dev is None else count + self.count_dev

    # -- checkpointing ----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "micro": self.micro,
            "count_host": self.count_host,
            "count_dev": None if self.count_dev is None else self.count_dev.clone(),
            "weighted": self.weighted,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro = int(state["micro"])
        self.count_host = float(state["count_host"])
        count_dev = state["count_dev"]
        self.count_dev = None if count_dev is None else count_dev.to(self.device, torch.float64)
        self.weighted = state["weighted"]


def weigh_loss(loss: torch.Tensor, weight: float | torch.Tensor) -> torch.Tensor:
    """loss * weight, for wrappers that reduce gradients inside backward (FSDP2/HSDP, DDP overlap).

    They sum each micro-step's gradient over ranks before the accumulator's
    hooks see it, so a per-rank weight must already be in the loss: what they
    reduce is then the weighted sum over ranks, as in "sum" mode. Computed in
    at least fp32: an fp16 loss times an item count can overflow.
    """
    dtype = torch.promote_types(loss.dtype, torch.float32)
    if isinstance(weight, torch.Tensor):
        weight = weight.to(dtype).reshape(loss.shape)
    return loss.to(dtype) * weight


def check_loss(loss: object) -> None:
    """A micro-step's loss must be a one-element tensor that requires grad."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise ValueError(
            "GradientAccumulator.backward: loss must be a one-element tensor that requires grad, got "
            + (
                f"shape {list(loss.shape)}, requires_grad={loss.requires_grad}"
                if isinstance(loss, torch.Tensor)
                else type(loss).__name__
            )
        )
