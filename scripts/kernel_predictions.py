"""Predicted device time of the headline kernels on an H100 and an H200, before any GPU has run them.

    predicted ms = bytes moved / (sustained copy bandwidth x efficiency)

* bytes moved: the byte model (gradacc_ext/benchmarking/operations.py; the fused step's 38 B/param
  floor, benchmarks/step_probes.py), for the workloads scripts/gpu_verify.sh benchmarks.
* sustained copy bandwidth: the datasheet peak x COPY_FRACTION. No large-buffer (HBM, not L2) copy
  measurement of either GPU was found to cite, so COPY_FRACTION is an assumption, the share of peak
  that a device-to-device copy sustains on HBM GPUs; the first GPU run measures the real figure (the
  harness's copy_/add_ roofline, in the same run as the kernels) and gpu_verify_report.py recomputes
  the prediction with it, beside the one made here.
* efficiency: what scripts/kernel_report.py's table supports. A kernel whose hot loop issues only
  128-bit global accesses, with no local memory and at least the occupancy floor, streams like a copy;
  EFFICIENCY discounts the per-block prologue (the slot search, the dtype dispatch, the chunk's tail)
  that a copy does not have. A kernel that misses any of the three gets REDUCED_EFFICIENCY.

This module is torch-free (gpu_verify_report.py imports it after a failed build too): the bytes come
from the caller, kernel_report.py (the byte model) or the run's own records.
"""

from __future__ import annotations

from dataclasses import dataclass

COPY_FRACTION = 0.90  # assumed: sustained device-to-device copy / datasheet peak (see above)
EFFICIENCY = 0.90  # a copy-like kernel (see above), of the sustained copy bandwidth
REDUCED_EFFICIENCY = 0.75  # a kernel with scalar hot-loop accesses, local memory or low occupancy


@dataclass(frozen=True)
class Gpu:
    key: str
    name: str
    arch: str
    peak_gbps: float
    source: str

    @property
    def copy_gbps(self) -> float:
        return self.peak_gbps * COPY_FRACTION


GPUS = (
    Gpu("H100", "NVIDIA H100 SXM5 80 GB (HBM3)", "sm_90", 3350.0, "NVIDIA H100 Tensor Core GPU datasheet: 3.35 TB/s"),
    Gpu("H200", "NVIDIA H200 SXM 141 GB (HBM3e)", "sm_90", 4800.0, "NVIDIA H200 Tensor Core GPU datasheet: 4.8 TB/s"),
)


@dataclass(frozen=True)
class Headline:
    """One measured figure of scripts/gpu_verify.sh: a compare.py cell or the fused-step benchmark's row."""

    key: str  # compare.py's operation key, or FUSED_STEP
    workload: str
    scale: float
    kernels: tuple[str, ...]  # the streaming kernels it launches (kernel_report.py's short names)
    lower_bound: bool = False  # launch-bound: the byte model gives a floor, not an estimate


FUSED_STEP = "fused_step"
ACC, ACC_FINAL = "accumulate_kernel<false, false>", "accumulate_kernel<true, false>"
OPTIM = "optim_kernel<AdamW, 0, fp32>"
NORM, CLIP = "norm_kernel<float, true>", "scale_kernel<clip_norm>"
HEADLINES = (
    Headline("acc_bf16", "gpt2-small", 1.0, (ACC,)),
    Headline("norm", "gpt2-small", 1.0, (NORM,)),
    Headline("tail", "gpt2-small", 1.0, (ACC_FINAL, CLIP)),
    Headline("acc_bf16", "small-2000", 1.0, (ACC,), lower_bound=True),
    Headline("norm", "small-2000", 1.0, (NORM,), lower_bound=True),
    Headline("tail", "small-2000", 1.0, (ACC_FINAL, CLIP), lower_bound=True),
    Headline(FUSED_STEP, "gpt2-small", 1.0, (ACC_FINAL, OPTIM)),
    Headline(FUSED_STEP, "gpt-1.3b", 0.5, (ACC_FINAL, OPTIM)),
)


def gpu_of(device_name: str) -> Gpu | None:
    """The modelled GPU a device name (torch.cuda.get_device_name) stands for, if any: the SXM parts
    only (an H100 PCIe or NVL has other memory and another bandwidth)."""
    name = device_name.upper()
    if "PCIE" in name or "NVL" in name:
        return None
    return next((gpu for gpu in GPUS if gpu.key in name), None)


def predict_ms(bytes_moved: float, copy_gbps: float, efficiency: float) -> float:
    return bytes_moved / (copy_gbps * 1e9 * efficiency) * 1e3
