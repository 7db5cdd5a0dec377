"""Hugging Face Transformers' Trainer with our optimizer: gradient_accumulation_steps=4,
max_grad_norm=1.0, optimizers=(FusedAdamW(...), scheduler), a tiny GPT-2 built from a config and
token ids made here (nothing downloaded). Padded labels (-100) give the micro-batches different token
counts, so Trainer's per-token normalisation over the window (num_items_in_batch) matters."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _common import ACCUM, assert_same_params, params_of  # noqa: E402

from gradacc_ext.optim import FusedAdamW  # noqa: E402

pytestmark = pytest.mark.frameworks
CLIP = 0.5  # below every window's gradient norm here (0.64-1.12 unclipped): every step clips
VOCAB, SEQ, BATCH, STEPS = 61, 12, 2, 3
STORED_AS = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}  # a state_dtype's exp_avg


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    """Rows of random token ids; row i keeps 3 + i % (SEQ - 3) real labels, the rest are -100."""

    def __init__(self, rows: int) -> None:
        gen = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].clone()
        labels[3 + i % (SEQ - 3) :] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def decay(step: int) -> float:
    return 1.0 / (1.0 + step)


def make_trainer(model, out, optimizer, max_grad_norm: float = CLIP, **kwargs) -> transformers.Trainer:
    args = transformers.TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUM,
        max_grad_norm=max_grad_norm,
        max_steps=kwargs.pop("max_steps", STEPS),
        learning_rate=1e-2,
        use_cpu=True,
        report_to=[],
        logging_strategy="no",
        save_strategy=kwargs.pop("save_strategy", "no"),
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        **kwargs,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
    return transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(BATCH * ACCUM * 4), optimizers=(optimizer, sched)
    )


def adamw(model, fused: bool, **kwargs) -> torch.optim.Optimizer:
    """eps=1e-6, not 1e-8: GPT-2's attention key bias gets a zero gradient up to rounding noise
    (softmax ignores it), and Adam divides that noise by sqrt(v) + eps. With eps=1e-8 an ulp of
    difference after the first step turns into lr-sized differences there, in torch against torch too."""
    cls = FusedAdamW if fused else torch.optim.AdamW
    return cls(model.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.1, **kwargs)


def train(tmp_path, name: str, fused: bool, **kwargs) -> dict[str, torch.Tensor]:
    model = tiny_gpt2()
    max_grad_norm = kwargs.pop("trainer_clip", CLIP)
    make_trainer(model, tmp_path / name, adamw(model, fused, **kwargs), max_grad_norm).train()
    return params_of(model)


def test_transformers_trainer_fused_adamw_equals_torch(tmp_path) -> None:
    start = params_of(tiny_gpt2())
    want = train(tmp_path, "torch", fused=False)
    assert_same_params(train(tmp_path, "fused", fused=True), want, start)
    # Clipping inside our step instead of Trainer's (max_grad_norm=0 turns Trainer's off).
    assert_same_params(train(tmp_path, "fused-clip", fused=True, max_grad_norm=CLIP, trainer_clip=0.0), want, start)


def test_transformers_num_items_in_batch_window_mean(tmp_path) -> None:
    """The gradient FusedAdamW receives from Trainer's first window is the gradient of the window's
    token-sum cross-entropy divided by the window's token count (Trainer's num_items_in_batch), with
    micro-batches of different token counts: our optimizer changes nothing about the normalisation."""
    model = tiny_gpt2()
    opt = adamw(model, fused=True)
    seen: list[list[torch.Tensor]] = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append([p.grad.clone() for p in model.parameters()]))
    batches: list[dict[str, torch.Tensor]] = []
    model.register_forward_pre_hook(lambda m, args, kwargs: batches.append(dict(kwargs)), with_kwargs=True)
    make_trainer(model, tmp_path / "t", opt, max_grad_norm=0.0, max_steps=1).train()
    assert len(seen) == 1 and len(batches) == ACCUM

    ref = tiny_gpt2()
    # Trainer's num_items_in_batch counts the window's labels != -100 before the causal shift (one
    # more per row than the positions the loss predicts): the same count for every micro-batch.
    tokens = [int((b["labels"] != -100).sum()) for b in batches]
    assert {int(b["num_items_in_batch"]) for b in batches} == {sum(tokens)}
    assert len(set(tokens)) > 1, "the micro-batches must hold different token counts"
    for b in batches:
        logits = ref(input_ids=b["input_ids"]).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).double(), b["labels"][:, 1:].flatten(), ignore_index=-100, reduction="sum"
        )
        (loss / sum(tokens)).backward()
    for got, (name, p) in zip(seen[0], ref.named_parameters(), strict=True):
        scale = float(p.grad.abs().max())
        assert scale > 0, name
        torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_transformers_resume_round_trips_fused_adamw_state(tmp_path, state_dtype) -> None:
    """Save at step 2 of 4, resume from that checkpoint in a fresh Trainer: the parameters and our
    optimizer's state equal the uninterrupted run's (int8: every tensor quantized, codes and scales; bf16: its
    stochastic rounding continues from the step count)."""
    options = {"state_dtype": state_dtype, "int8_min_numel": 0}
    model = tiny_gpt2()
    start = params_of(model)
    opt = adamw(model, fused=True, **options)
    make_trainer(model, tmp_path / "full", opt, max_steps=4, save_strategy="steps", save_steps=2).train()
    want, want_state = params_of(model), opt.state_dict()

    model = tiny_gpt2()
    opt = adamw(model, fused=True, **options)
    trainer = make_trainer(model, tmp_path / "full", opt, max_steps=4)
    trainer.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert_same_params(params_of(model), want, start)
    got_state = opt.state_dict()
    assert got_state["state"].keys() == want_state["state"].keys()
    for pid, state in want_state["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq", *(("exp_avg_scales",) if state_dtype == "int8" else ())):
            torch.testing.assert_close(got_state["state"][pid][key], state[key], rtol=1e-5, atol=1e-7)
        assert state["exp_avg"].dtype == STORED_AS[state_dtype]
    assert float(want_state["state"][0]["step"]) == 4.0
