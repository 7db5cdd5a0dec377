"""Theoretical occupancy of a kernel from its resources: the arithmetic half of scripts/kernel_report.py.

The limits per architecture, written down once. Source: NVIDIA, CUDA C++ Programming Guide, "Compute
Capabilities", table "Technical Specifications per Compute Capability" (CUDA 13.0), for 8.0, 9.0 and
10.0; the allocation granularities (registers per warp in units of 256, shared memory in units of 128
bytes, 1 KB of shared memory reserved by the system per block since 8.0) as the CUDA Occupancy
Calculator (Nsight Compute's occupancy section) applies them, and as cudaOccupancyMaxActiveBlocksPerMultiprocessor
computes: resident blocks = the least of the four limits below.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchLimits:
    arch: str
    gpus: str
    max_threads_per_sm: int
    max_blocks_per_sm: int
    registers_per_sm: int
    max_registers_per_thread: int
    register_unit_per_warp: int  # registers are allocated per warp in multiples of this
    smem_per_sm: int  # bytes of shared memory an SM can give to blocks (the L1 carve-out's maximum)
    smem_reserved_per_block: int  # bytes the system keeps per resident block
    smem_unit: int


KIB = 1024
ARCHS = {
    "sm_80": ArchLimits("sm_80", "A100", 2048, 32, 65536, 255, 256, 164 * KIB, KIB, 128),
    "sm_90": ArchLimits("sm_90", "H100, H200", 2048, 32, 65536, 255, 256, 228 * KIB, KIB, 128),
    "sm_100": ArchLimits("sm_100", "B200, B300", 2048, 32, 65536, 255, 256, 228 * KIB, KIB, 128),
}
WARP = 32


@dataclass(frozen=True)
class Occupancy:
    blocks: int  # resident blocks per SM
    percent: float  # resident warps / the SM's maximum
    limiter: str  # which limit sets `blocks`


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def occupancy(limits: ArchLimits, registers: int, static_smem: int, block_threads: int) -> Occupancy:
    """Resident blocks per SM, and the share of the SM's warps they fill, at `block_threads` per block."""
    warps_per_block = -(-block_threads // WARP)
    regs_per_warp = _round_up(max(registers, 1) * WARP, limits.register_unit_per_warp)
    smem_per_block = _round_up(static_smem, limits.smem_unit) + limits.smem_reserved_per_block
    by_limit = {
        "threads": limits.max_threads_per_sm // (warps_per_block * WARP),
        "blocks": limits.max_blocks_per_sm,
        "registers": (limits.registers_per_sm // regs_per_warp) // warps_per_block,
        "shared memory": limits.smem_per_sm // smem_per_block,
    }
    limiter = min(by_limit, key=lambda k: by_limit[k])
    blocks = by_limit[limiter]
    percent = 100.0 * blocks * warps_per_block / (limits.max_threads_per_sm // WARP)
    return Occupancy(blocks, percent, limiter)


def max_registers_for(limits: ArchLimits, blocks: int, block_threads: int) -> int:
    """The most registers per thread that still lets `blocks` blocks of `block_threads` be resident."""
    warps = blocks * -(-block_threads // WARP)
    per_warp = (limits.registers_per_sm // warps) // limits.register_unit_per_warp * limits.register_unit_per_warp
    return min(per_warp // WARP, limits.max_registers_per_thread)
