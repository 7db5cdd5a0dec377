"""What the framework tests share: tiny regression data, the fp32 tolerance of tests/optim/test_optim.py,
and a parameter comparison that names the parameter that differs."""

from __future__ import annotations

import torch

TOL = {"rtol": 1e-5, "atol": 1e-6}  # tests/optim/test_optim.py's FusedAdamW-vs-torch tolerance (fp32)
ACCUM = 4
CLIP = 1.0


def regression_data(
    batches: int, batch_size: int = 3, features: int = 7, seed: int = 0
) -> torch.utils.data.TensorDataset:
    """batches * batch_size rows of a noisy linear target (odd sizes, never all-zero)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batches * batch_size, features, generator=gen)
    y = 5 * x @ torch.randn(features, 2, generator=gen) + 0.1 * torch.randn(batches * batch_size, 2, generator=gen)
    return torch.utils.data.TensorDataset(x, y)


def tiny_mlp(seed: int = 0, features: int = 7) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(features, 13), torch.nn.Tanh(), torch.nn.Linear(13, 2))


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_same_params(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], start: dict[str, torch.Tensor]
) -> None:
    """Equal within TOL, and both moved away from `start` (a run that never stepped cannot pass)."""
    assert got.keys() == want.keys()
    for name in want:
        assert not torch.equal(want[name], start[name]), f"{name}: the reference run did not change it"
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
