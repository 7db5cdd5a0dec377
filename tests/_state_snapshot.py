"""Everything a load could write, copied: a model's params and its optimizer's states and group keys, by name; and
the entries that differ between two such copies (for "refused before anything is written" checks)."""

from __future__ import annotations

import torch


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, object]:
    """Every param, every optimizer state entry and every group key, copied, by name."""
    taken: dict[str, object] = {}
    for name, p in model.named_parameters():
        taken[name] = p.detach().clone()
        for key, value in opt.state[p].items():
            taken[f"state {name} {key}"] = value.clone() if isinstance(value, torch.Tensor) else value
    for g, group in enumerate(opt.param_groups):
        taken.update({f"group {g} {key}": value for key, value in group.items() if key != "params"})
    return taken


def changed(before: dict[str, object], after: dict[str, object]) -> list[str]:
    """The entries that differ in value, dtype or type (or exist on one side only)."""

    def same(old: object, new: object) -> bool:
        if isinstance(old, torch.Tensor):
            return isinstance(new, torch.Tensor) and old.dtype == new.dtype and torch.equal(old, new)
        return type(old) is type(new) and old == new

    return sorted(set(before) ^ set(after)) + [k for k in before if k in after and not same(before[k], after[k])]
