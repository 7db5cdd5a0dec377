"""`gradacc plan --probe`: the largest micro-batch of a built-in model that fits in GPU memory.

The model is the demo's causal transformer at a preset size. The probe holds
what training holds (parameters, AdamW state, gradients) and runs one
forward and backward per trial size; planning.probe_max_micro_batch_size
does the search (doubling, then bisection, recovering from each OOM).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from ..planning import probe_max_micro_batch_size
from .demo_data import Batch
from .demo_model import ModelConfig, TinyCausalLM, token_loss_sum

PRESETS = {
    "demo": ModelConfig(),
    # GPT-2 small's shape (about 163M parameters here: the LM head is not tied), a common yardstick.
    "gpt2-small": ModelConfig(vocab_size=50257, max_len=1024, d_model=768, n_heads=12, n_layers=12),
}
AMP_DTYPES = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}
NO_CUDA = "--probe needs a CUDA GPU (torch.cuda.is_available() is False); give --micro-batch instead"


class ProbeRun:
    """run(size): one forward and backward of `size` sequences of `seq_len` tokens, with training's memory held."""

    def __init__(self, preset: str, seq_len: int, amp: str, device: torch.device) -> None:
        if preset not in PRESETS:
            raise ValueError(f"preset must be one of {tuple(PRESETS)}, got {preset!r}")
        self.config = PRESETS[preset]
        if not 2 <= seq_len <= self.config.max_len:
            raise ValueError(f"seq_len must be in [2, {self.config.max_len}] for preset {preset!r}, got {seq_len}")
        self.seq_len, self.dtype, self.device = seq_len, AMP_DTYPES[amp], device
        self.model = TinyCausalLM(self.config).to(device)
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()  # materialises AdamW's two state tensors per parameter, as in training
        self.optimizer = optimizer  # held so its state stays allocated while probing

    def __call__(self, size: int) -> None:
        tokens = torch.randint(1, self.config.vocab_size, (size, self.seq_len), device=self.device)
        batch = Batch(tokens, torch.full((size,), self.seq_len, device=self.device))
        with nullcontext() if self.dtype is None else torch.autocast(self.device.type, dtype=self.dtype):
            loss = token_loss_sum(self.model, batch)
        loss.backward()  # into the held gradients; the activations are freed on return


def probe_micro_batch(preset: str, seq_len: int, amp: str, upper: int) -> int:
    """The largest micro-batch in [1, upper] that fits on the current CUDA device."""
    if not torch.cuda.is_available():
        raise RuntimeError(NO_CUDA)
    return probe_max_micro_batch_size(ProbeRun(preset, seq_len, amp, torch.device("cuda")), upper)
