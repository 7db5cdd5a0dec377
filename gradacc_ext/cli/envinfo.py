"""What `gradacc info` reports: build against runtime, GPU archs, each op's backend, and the optimizer state
storages (state_dtype) the optimizer steps take there."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from .. import __version__, build_info
from ..ops import coverage as gpu_coverage
from ..ops import resolve_backend, runs_with
from ..ops.core_args import CORE_RECORDS
from ..ops.optim_args import RECORDS
from ..optim.state_storage import STATE_DTYPES
from . import wheel_choice

OPS = tuple(record.NAME for record in (*CORE_RECORDS, *RECORDS))  # the core ops, then the optimizer steps


def collect() -> dict[str, Any]:
    """Everything `gradacc info` prints, as plain JSON-able data."""
    build = build_info()
    running_torch = build["running_torch_version"].split("+")[0]
    # Every visible GPU, with the path the ops take on it (the same decision they make on first use).
    gpus = [asdict(gpu_coverage.decide(gpu_coverage.device_facts(i))) for i in range(torch.cuda.device_count())]
    devices = ["cpu"] + (["cuda"] if gpus else [])
    backends: dict[str, dict[str, dict[str, str]]] = {}
    for device in devices:
        backends[device] = {}
        for op in OPS:
            # The choice is made per device type today; asking per op keeps this
            # report right if an op ever gains or loses a kernel of its own.
            chosen, reason = resolve_backend(device, "auto")
            backends[device][op] = {"backend": chosen, "reason": reason}
    storages = {device: state_storages(per_op["adamw_step_"]["backend"]) for device, per_op in backends.items()}
    return {
        "version": __version__,
        "extension_loaded": build["extension_loaded"],
        "load_reason": build["reason"],
        "torch": {
            "built": build["built_torch_version"],
            "running": build["running_torch_version"],
            # A stable-ABI build loads in every torch from its minimum on (issue 22).
            "abi": build["abi"],
            "min": build["min_torch_version"],
            "match": runs_with(running_torch, build["min_torch_version"]),
        },
        "cuda": {
            "built": build["built_cuda_version"],
            "running": build["running_cuda_version"],
            "available": build["cuda_available"],
            "with_cuda_kernels": build["with_cuda"],
            "stream_lookup": build["cuda_stream"],
        },
        "arch_list": build["arch_list"],
        "cpu": {
            "isa": build["cpu_isa"],
            "compiled": build["cpu_isas"],
            "torch_capability": torch.backends.cpu.get_cpu_capability(),
        },
        "gpus": gpus or None,
        "backends": backends,
        "state_storages": storages,
        "wheel": _wheel(build["built_cuda_version"]),
    }


def state_storages(backend: str) -> list[str]:
    """The optimizers' state_dtype values the steps take on `backend`: the reference ("torch") takes all; the
    compiled kernels those their schema has lists for (the low-bit storages came with the scales lists)."""
    if backend == "torch":
        return list(STATE_DTYPES)
    arguments = {argument.name for argument in torch.ops.gradacc.adamw_step_.default._schema.arguments}
    return list(STATE_DTYPES) if "exp_avgs_scales" in arguments else [STATE_DTYPES[0]]


def _wheel(built_cuda: str | None) -> dict[str, Any]:
    """Which release wheel fits this machine (scripts/which_wheel.py's answer), beside the one installed."""
    machine = wheel_choice.probe()
    variant, reason = wheel_choice.choose(machine)
    installed = "cu" + built_cuda.replace(".", "") if built_cuda else "cpu"
    return {"installed": installed, "fits": variant, "reason": reason, "facts": wheel_choice.describe(machine)[0]}


def render(info: dict[str, Any]) -> str:
    """The human-readable form of collect()'s result."""
    torch_info, cuda_info, gpus = info["torch"], info["cuda"], info["gpus"]
    lines = [
        f"gradacc_ext {info['version']}",
        f"extension:  {'loaded' if info['extension_loaded'] else 'NOT loaded'} ({info['load_reason']})",
        f"torch:      {torch_info['abi'] or '-'} ABI, built with torch {torch_info['built'] or '-'}, runs with torch "
        f">= {torch_info['min'] or '-'}; running {torch_info['running']}"
        + ("" if torch_info["match"] or not torch_info["built"] else "  <- TOO OLD"),
        f"CUDA:       built {cuda_info['built'] or 'none (CPU-only build)'}, running {cuda_info['running'] or 'none'}"
        f", GPU available: {'yes' if cuda_info['available'] else 'no'}"
        + (f", current stream: {cuda_info['stream_lookup']}" if cuda_info.get("stream_lookup") else ""),
        f"GPU archs:  compiled {info['arch_list'] or 'none'}",
        f"CPU ISA:    {info['cpu']['isa'] or 'none'} (compiled: {', '.join(info['cpu']['compiled']) or 'none'}; "
        f"torch capability {info['cpu']['torch_capability']})",
    ]
    if gpus is None:
        lines.append("GPU:        none visible (torch.cuda.is_available() is False)")
    for gpu in gpus or []:
        verdict = "covered" if gpu["covered"] else "NOT COVERED"
        lines.append(
            f"GPU:        {gpu['device']} {gpu['name']}, compute {gpu['capability']}: {verdict}, "
            f"{gpu['path']} ({gpu['reason']})"
        )
    wheel = info["wheel"]
    verdict = "the one installed" if wheel["fits"] == wheel["installed"] else f"installed: {wheel['installed']}"
    lines.append(f"wheel:      {wheel['fits'] or 'none, build from source'} fits ({verdict}): {wheel['reason']}")
    lines.append(f"            {wheel['facts']}")
    for device, storages in info["state_storages"].items():
        lines.append(f"states:     {device} optimizer state_dtype: {', '.join(storages)}")
    lines.append("backends (backend='auto'):")
    width = max(len(op) for op in OPS)
    for device, per_op in info["backends"].items():
        for op, choice in per_op.items():
            lines.append(f"  {device:<4} {op:<{width}}  {choice['backend']:<5}  {choice['reason']}")
    return "\n".join(lines)
