"""What `gradacc info` reports: build against runtime, GPU archs, and each op's backend."""

from __future__ import annotations

import re
from typing import Any

import torch

from .. import __version__, build_info
from ..ops import resolve_backend

OPS = ("accumulate_", "accumulate_final_", "global_norm", "unscale_", "clip_by_norm_", "clip_by_value_")
_ARCH = re.compile(r"^(\d+)\.(\d+)([a-z]?)(\+PTX)?$")


def parse_arch_list(arch_list: str) -> list[tuple[int, int, str, bool]]:
    """TORCH_CUDA_ARCH_LIST ("8.0;9.0+PTX", also space-separated) -> [(major, minor, suffix, ptx)].

    Entries that are not of the X.Y[a][+PTX] form are skipped.
    """
    entries = []
    for item in re.split(r"[;\s]+", arch_list.strip()):
        match = _ARCH.match(item)
        if match:
            entries.append((int(match[1]), int(match[2]), match[3], bool(match[4])))
    return entries


def arch_coverage(arch_list: str | None, capability: tuple[int, int]) -> tuple[bool, str]:
    """Whether kernels built for `arch_list` run on a GPU of compute `capability`, and why.

    A cubin for X.Y runs on X.Z with Z >= Y (same major); an arch-specific one
    (9.0a) only on exactly 9.0; PTX for X.Y is JIT-compiled on any newer GPU.
    """
    major, minor = capability
    name = f"{major}.{minor}"
    if not arch_list:
        return False, "the extension has no CUDA kernels"
    for a_major, a_minor, suffix, _ in parse_arch_list(arch_list):
        exact = (a_major, a_minor) == (major, minor)
        if exact or (not suffix and a_major == major and a_minor < minor):
            return True, f"compute {name} runs the {a_major}.{a_minor}{suffix} binary"
    for a_major, a_minor, _, ptx in parse_arch_list(arch_list):
        if ptx and (a_major, a_minor) <= (major, minor):
            return True, f"compute {name} JIT-compiles the {a_major}.{a_minor} PTX (slow first launch)"
    return False, (
        f"no binary or PTX in {arch_list!r} runs on compute {name}: rebuild with TORCH_CUDA_ARCH_LIST including {name}"
    )


def collect() -> dict[str, Any]:
    """Everything `gradacc info` prints, as plain JSON-able data."""
    build = build_info()
    running_torch = build["running_torch_version"].split("+")[0]
    gpu: dict[str, Any] | None = None
    devices = ["cpu"]
    if torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        covered, why = arch_coverage(build["arch_list"] if build["with_cuda"] else None, capability)
        gpu = {
            "name": torch.cuda.get_device_name(),
            "capability": f"{capability[0]}.{capability[1]}",
            "covered": covered,
            "reason": why,
        }
        devices.append("cuda")
    backends: dict[str, dict[str, dict[str, str]]] = {}
    for device in devices:
        backends[device] = {}
        for op in OPS:
            # The choice is made per device type today; asking per op keeps this
            # report right if an op ever gains or loses a kernel of its own.
            chosen, reason = resolve_backend(device, "auto")
            backends[device][op] = {"backend": chosen, "reason": reason}
    return {
        "version": __version__,
        "extension_loaded": build["extension_loaded"],
        "load_reason": build["reason"],
        "torch": {
            "built": build["built_torch_version"],
            "running": build["running_torch_version"],
            "match": build["built_torch_version"] == running_torch,
        },
        "cuda": {
            "built": build["built_cuda_version"],
            "running": build["running_cuda_version"],
            "available": build["cuda_available"],
            "with_cuda_kernels": build["with_cuda"],
        },
        "arch_list": build["arch_list"],
        "cpu": {
            "isa": build["cpu_isa"],
            "compiled": build["cpu_isas"],
            "torch_capability": torch.backends.cpu.get_cpu_capability(),
        },
        "gpu": gpu,
        "backends": backends,
    }


def render(info: dict[str, Any]) -> str:
    """The human-readable form of collect()'s result."""
    torch_info, cuda_info, gpu = info["torch"], info["cuda"], info["gpu"]
    lines = [
        f"gradacc_ext {info['version']}",
        f"extension:  {'loaded' if info['extension_loaded'] else 'NOT loaded'} ({info['load_reason']})",
        f"torch:      built {torch_info['built'] or '-'}, running {torch_info['running']}"
        + ("" if torch_info["match"] or not torch_info["built"] else "  <- MISMATCH"),
        f"CUDA:       built {cuda_info['built'] or 'none (CPU-only build)'}, running {cuda_info['running'] or 'none'}"
        f", GPU available: {'yes' if cuda_info['available'] else 'no'}",
        f"GPU archs:  compiled {info['arch_list'] or 'none'}",
        f"CPU ISA:    {info['cpu']['isa'] or 'none'} (compiled: {', '.join(info['cpu']['compiled']) or 'none'}; "
        f"torch capability {info['cpu']['torch_capability']})",
    ]
    if gpu is None:
        lines.append("GPU:        none visible (torch.cuda.is_available() is False)")
    else:
        verdict = "ok" if gpu["covered"] else "NOT COVERED"
        lines.append(f"GPU:        {gpu['name']}, compute {gpu['capability']}: {verdict} ({gpu['reason']})")
    lines.append("backends (backend='auto'):")
    width = max(len(op) for op in OPS)
    for device, per_op in info["backends"].items():
        for op, choice in per_op.items():
            lines.append(f"  {device:<4} {op:<{width}}  {choice['backend']:<5}  {choice['reason']}")
    return "\n".join(lines)
