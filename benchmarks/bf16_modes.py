"""How FusedAdamW's bf16 param modes track fp32 master weights on the demo model (issue 10, item 2).

Trains the demo's TinyCausalLM with bf16 params and float32 grads (Tensor.grad_dtype) in the three
param modes, plus an all-fp32 run for scale, from the same initial weights and the same batches,
and writes the loss curves to a PNG (and the final losses to stdout).

    PYTHONPATH=. python benchmarks/bf16_modes.py --steps 400 --out docs/bf16_modes.png
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch

from gradacc_ext.cli.demo_data import TaskConfig, make_batch
from gradacc_ext.cli.demo_model import ModelConfig, TinyCausalLM, token_loss_sum
from gradacc_ext.cli.demo_plot import moving_average
from gradacc_ext.optim import FusedAdamW

RUNS = {  # label: (param dtype, param_mode)
    "fp32 params": (torch.float32, "nearest"),
    "bf16, (a) fp32 master weights": (torch.bfloat16, "master"),
    "bf16, (b) stochastic rounding": (torch.bfloat16, "stochastic"),
    "bf16, (c) round-to-nearest": (torch.bfloat16, "nearest"),
}


def train(model: TinyCausalLM, dtype: torch.dtype, mode: str, steps: int, lr: float, seed: int) -> list[float]:
    model = copy.deepcopy(model).to(dtype)
    for p in model.parameters():
        p.grad_dtype = torch.float32  # fp32 grads on bf16 params, as from fp32 accumulation buffers
    opt = FusedAdamW(model.parameters(), lr=lr, weight_decay=0.01, param_mode=mode, seed=seed)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    data, losses = torch.Generator().manual_seed(seed), []
    for _ in range(steps):
        batch = make_batch(TaskConfig(), 32, data)
        opt.zero_grad()
        loss = token_loss_sum(model, batch) / batch.num_tokens()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("docs/bf16_modes.png"))
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model = TinyCausalLM(ModelConfig())
    curves = {label: train(model, dtype, mode, args.steps, args.lr, args.seed) for label, (dtype, mode) in RUNS.items()}
    tail = max(1, args.steps // 10)
    for label, losses in curves.items():
        print(f"{label:32s} mean loss of the last {tail} steps: {sum(losses[-tail:]) / tail:.4f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, losses in curves.items():
        ax.plot(moving_average(losses, 20), label=label, linewidth=1.2)
    ax.set(xlabel="optimizer step", ylabel="train loss (moving average of 20)", yscale="log")
    ax.set_title(f"FusedAdamW param modes on the demo model (lr {args.lr:g}, cosine)")
    ax.legend()
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
