"""The benchmarked operations and their byte model.

The byte model counts the bytes an operation must move at the least: every
input element read once and every output element written once, whatever
passes an implementation actually makes. All implementations of one cell are
charged the same bytes, so GB/s is "useful work per second" and comparable
across implementations (an implementation that makes extra passes shows a
lower figure; it is not credited for its extra traffic).

Per element, with g = the grad's element size (2 for bf16, 4 for fp32) and
fp32 buffers/params/optimizer states:

* accumulate     buf += grad                         read g + 4, write 4      = g + 8
* final tail     buf = (buf + grad) * inv_scale, inf check, global norm
                 (one pass: read g + 4, write 4), then clip by that norm
                 (a second pass is unavoidable: the coefficient needs the
                 finished norm; read 4, write 4)                            = g + 16
* norm           read 4                                                      = 4
* clip           read 4, write 4                                             = 8
* tail + AdamW   the final tail, then AdamW: read param, grad, exp_avg,
                 exp_avg_sq (16), write param, exp_avg, exp_avg_sq (12)     = g + 44
* unscale alone  in place on a list of dtype b (4, or 2 for bf16/fp16):
                 read b, write b                                             = 2b
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP32 = 4
ADAMW_BYTES = 16 + 12


@dataclass(frozen=True)
class Operation:
    key: str
    title: str
    grad_dtype: torch.dtype | None  # dtype of the micro-step grads; None: the op reads no grads
    needs_optimizer: bool = False
    ours: bool = True  # False when most of the work is not gradacc's (AdamW)
    buf_dtype: torch.dtype = torch.float32  # dtype of the buffers the op works on

    @property
    def unscale_alone(self) -> bool:
        return self.key.startswith("unscale_")

    def bytes_per_element(self) -> int:
        g = torch.empty((), dtype=self.grad_dtype).element_size() if self.grad_dtype is not None else 0
        if self.unscale_alone:
            return 2 * torch.empty((), dtype=self.buf_dtype).element_size()
        return {
            "acc_bf16": g + 2 * FP32,
            "acc_fp32": g + 2 * FP32,
            "tail": g + 4 * FP32,
            "norm": FP32,
            "clip": 2 * FP32,
            "tail_adamw": g + 4 * FP32 + ADAMW_BYTES,
        }[self.key]

    def bytes_moved(self, numel: int) -> int:
        return self.bytes_per_element() * numel


OPERATIONS = {
    op.key: op
    for op in (
        Operation("acc_bf16", "accumulate bf16->fp32", torch.bfloat16),
        Operation("acc_fp32", "accumulate fp32->fp32", torch.float32),
        Operation("tail", "final tail (acc+unscale+inf+norm+clip)", torch.bfloat16),
        Operation("norm", "global norm", None),
        Operation("clip", "clip by norm", None),
        Operation("tail_adamw", "final tail + AdamW step", torch.bfloat16, needs_optimizer=True, ours=False),
        Operation("unscale_fp32", "unscale alone (fp32, check + multiply)", None, buf_dtype=torch.float32),
        Operation("unscale_bf16", "unscale alone (bf16, check + multiply)", None, buf_dtype=torch.bfloat16),
        Operation("unscale_fp16", "unscale alone (fp16, check + multiply)", None, buf_dtype=torch.float16),
    )
}


def parse_operations(spec: str) -> list[Operation]:
    keys = [k.strip() for k in spec.split(",") if k.strip()]
    unknown = [k for k in keys if k not in OPERATIONS]
    if unknown or not keys:
        raise ValueError(f"operations must be a comma list of {list(OPERATIONS)}, got {spec!r}")
    return [OPERATIONS[k] for k in keys]
