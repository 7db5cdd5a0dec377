"""Fresh random inputs of the fused optimizer steps with low-bit states (bf16, int8 codes and scales): the
op tests' (tests/ops/test_optim_lowbit*.py) view of LOWBIT_SPEC.md. Built on _optim_inputs' fp32 inputs, whose
random states are converted (int8: quantized by the reference's encoder), so no state is all zero."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from _optim_inputs import OptimInfo, StepInputs, make_inputs
from _oracle import bits

from gradacc_ext.ops import reference_lowbit
from gradacc_ext.ops.optim_args import OptimStep, scales_name


def unaligned_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `t` one element past the start of its storage (no 16-byte alignment)."""
    out = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
    return out.copy_(t)


@dataclass
class LowbitInputs:
    """StepInputs whose state lists are bf16 or uint8 codes, with the int8 scales per state slot."""

    x: StepInputs
    storage: str  # "bf16" | "int8"
    scales: list[list[torch.Tensor]]  # per slot (exp_avgs, exp_avg_sqs, max_exp_avg_sqs): empty unless int8

    def slots(self) -> list[list[torch.Tensor]]:
        return [self.x.exp_avgs, self.x.exp_avg_sqs, self.x.max_exp_avg_sqs]

    def scales_kwargs(self, info: OptimInfo) -> dict[str, list[torch.Tensor]]:
        """The op's <state>_scales keywords (slot order), for the int8 states the call passes."""
        if self.storage != "int8":
            return {}
        return {scales_name(name): self.scales[s] for s, (name, _) in enumerate(info.record.STATE) if self.scales[s]}

    def call(self, info: OptimInfo, backend: str, lr: float, **options) -> None:
        info.call(self.x, backend, lr, **options, **self.scales_kwargs(info))

    def record(self, info: OptimInfo, options: dict, lr: float, mode: str = "nearest", seed: int = 0) -> OptimStep:
        """The op's argument record (for calling the reference directly)."""
        base = info.record_of(self.x, options, lr, (None, None, None), mode, seed)
        return replace(base, **self.scales_kwargs(info))

    def all_tensors(self) -> list[torch.Tensor]:
        return [*self.x.all_tensors(), *(t for lists in self.scales for t in lists)]

    def clone(self) -> LowbitInputs:
        return LowbitInputs(self.x.clone(), self.storage, [[t.clone() for t in lists] for lists in self.scales])


def to_storage(x: StepInputs, info: OptimInfo, storage: str, *, unaligned: bool = False) -> LowbitInputs:
    """`x` (fp32 states) with its states stored as `storage`: bf16, or int8 codes of the reference's encoder."""
    lists = [x.exp_avgs, x.exp_avg_sqs, x.max_exp_avg_sqs]
    scales: list[list[torch.Tensor]] = [[], [], []]
    place = unaligned_copy if unaligned else (lambda t: t)
    for s, tensors in enumerate(lists):
        if s >= len(info.record.SIGNED):
            break
        for i, t in enumerate(tensors):
            if storage == "bf16":
                tensors[i] = place(t.to(torch.bfloat16))
            else:
                codes, absmax = reference_lowbit.encode(t, info.record.SIGNED[s])
                tensors[i] = place(codes)
                scales[s].append(place(absmax))
    return LowbitInputs(x, storage, scales)


def lowbit_inputs(
    info: OptimInfo,
    config: dict,
    sizes: Sequence[int],
    storage: str,
    gen: torch.Generator,
    *,
    param_dtype: torch.dtype = torch.float32,
    grad_dtype: torch.dtype | None = None,
    unaligned: bool = False,
    first_step: bool = False,
) -> LowbitInputs:
    x = make_inputs(sizes, param_dtype, "cpu", gen, grad_dtype=grad_dtype, optimizer=info.name,
                    amsgrad=bool(config.get("amsgrad")), unaligned=unaligned, first_step=first_step)  # fmt: skip
    return to_storage(x, info, storage, unaligned=unaligned)


def to_device(inputs: LowbitInputs, device: str) -> LowbitInputs:
    """A copy of `inputs` on `device`, each tensor as aligned as its original (unaligned_copy's one element off)."""

    def move(t: torch.Tensor) -> torch.Tensor:
        moved = t.to(device, copy=True)
        return unaligned_copy(moved) if t.data_ptr() % 16 else moved

    x = StepInputs(*([move(t) for t in group] for group in (*inputs.x.lists(), inputs.x.steps)))
    return LowbitInputs(x, inputs.storage, [[move(t) for t in lists] for lists in inputs.scales])


def new_grads(x: StepInputs, gen: torch.Generator) -> list[torch.Tensor]:
    """Fresh random grads of x's grads' shapes and dtypes."""
    return [torch.randn(g.shape, generator=gen).to(g.dtype) for g in x.grads]


def assert_same_as_reference(got: LowbitInputs, want: LowbitInputs, info: OptimInfo) -> None:
    """States, codes, scales and steps bit for bit; params too, but AdamW's, which the kernel and the reference
    round differently by a few ulps already with fp32 states (its state never reads the param)."""
    params = {id(p) for p in (*got.x.params, *got.x.master_params)}
    for i, (g, w) in enumerate(zip(got.all_tensors(), want.all_tensors(), strict=True)):
        if info.name == "adamw" and id(g) in params:
            # one 16-bit ulp: the few float32 ulps apart may round (or stochastically round) to the other neighbour
            tol = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}.get(g.dtype, 1e-5)
            torch.testing.assert_close(g, w, rtol=tol, atol=tol * 1e-2)
        else:
            assert torch.equal(bits(g), bits(w)), f"tensor {i} ({g.dtype}, {list(g.shape)}) differs"
