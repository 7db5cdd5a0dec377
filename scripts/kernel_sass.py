"""What a kernel's SASS says about its memory traffic: the parsing half of scripts/kernel_report.py.

Input: the text `cuobjdump -sass OBJECT` prints (one section per `arch = sm_XX`, one listing per
`Function : NAME`) and the `ptxas -v` log nvcc writes with `-Xptxas -v`. Output, per (arch, kernel):
its resources (registers, spills, stack frame, static shared memory) and its SASS facts (128-bit
global accesses, scalar global accesses in the vectorised hot loop, local-memory instructions).

A loop is a backward branch: `BRA target` with target <= the branch's own address; its body is the
address range [target, branch]. The hot loop of a vectorised kernel is an innermost loop holding a
128-bit global access (one per dtype pair the kernel dispatches on). Counted in it: scalar accesses,
global loads and stores of one 32- or 16-bit element (LDG/STG, or generic LD/ST, which ptxas emits
when it cannot prove the pointer global), and 64-bit ones apart (the optimizer's 4-element groups of
a 16-bit list; a float64 path never holds a 128-bit access).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

ARCH = re.compile(r"^\s*arch = (sm_\d+)")
FUNCTION = re.compile(r"^\s*Function : (\S+)")
# /*0440*/   @!P0 LDG.E.128 R4, desc[UR4][R2.64] ;
INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
BRANCH_TARGET = re.compile(r"0x([0-9a-f]+)")
WIDTH_SUFFIX = re.compile(r"\.(256|128|64|U16|S16|U8|S8)\b")
WIDTHS = {"256": 256, "128": 128, "64": 64, "U16": 16, "S16": 16, "U8": 8, "S8": 8}

# ptxas -v
PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+)'")
PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
PTXAS_USED = re.compile(r"Used (\d+) registers")
PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


@dataclass(frozen=True)
class Instr:
    addr: int
    op: str  # opcode with its modifiers: LDG.E.128
    operands: str


@dataclass
class Resources:
    registers: int = 0
    stack_frame: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    static_smem: int = 0


@dataclass
class SassFacts:
    loads_128: int = 0  # 128-bit (or wider) global loads
    stores_128: int = 0
    scalar_loads: int = 0  # narrower global loads, anywhere in the kernel
    scalar_stores: int = 0
    local_ops: int = 0  # LDL / STL
    hot_loops: int = 0  # innermost loops holding a 128-bit global access
    hot_loop_scalar: list[int] = field(default_factory=list)  # global accesses < 64 bits in each hot loop
    hot_loop_64: list[int] = field(default_factory=list)  # 64-bit global accesses in each hot loop
    hot_loop_load_bytes: list[int] = field(default_factory=list)  # bytes one thread's iteration loads, per loop


def parse_sass(text: str) -> dict[tuple[str, str], list[Instr]]:
    """(arch, mangled kernel name) -> its instructions, in address order."""
    kernels: dict[tuple[str, str], list[Instr]] = {}
    arch, current = "", None
    for line in text.splitlines():
        if m := ARCH.match(line):
            arch, current = m.group(1), None
        elif m := FUNCTION.match(line):
            current = kernels.setdefault((arch, m.group(1)), [])
        elif current is not None and (m := INSTR.match(line)):
            current.append(Instr(int(m.group(1), 16), m.group(3), m.group(4).strip()))
    return kernels


def parse_ptxas_log(text: str) -> dict[tuple[str, str], Resources]:
    """(arch, mangled kernel name) -> its resources, from nvcc's `-Xptxas -v` output."""
    found: dict[tuple[str, str], Resources] = {}
    key = None
    for line in text.splitlines():
        if m := PTXAS_ENTRY.search(line):
            key = (m.group(2), m.group(1))
            found[key] = Resources()
        elif key is None:
            continue
        elif m := PTXAS_FRAME.search(line):
            found[key].stack_frame, found[key].spill_stores, found[key].spill_loads = map(int, m.groups())
        elif m := PTXAS_USED.search(line):
            found[key].registers = int(m.group(1))
            if s := PTXAS_SMEM.search(line):
                found[key].static_smem = int(s.group(1))
            key = None  # the entry's last line
    return found


def global_access(op: str) -> str | None:
    """'load' or 'store' for a global (or generic) memory instruction, else None."""
    head = op.split(".")[0]
    if head in ("LDG", "LD"):
        return "load"
    if head in ("STG", "ST"):
        return "store"
    return None


def access_bits(op: str) -> int:
    m = WIDTH_SUFFIX.search(op)
    return WIDTHS[m.group(1)] if m else 32


def loops(instrs: list[Instr]) -> list[tuple[int, int]]:
    """(first address, last address) of every backward branch's body."""
    found = []
    for ins in instrs:
        if ins.op.split(".")[0] == "BRA" and (m := BRANCH_TARGET.search(ins.operands)):
            target = int(m.group(1), 16)
            if target <= ins.addr:
                found.append((target, ins.addr))
    return found


def analyse(instrs: list[Instr]) -> SassFacts:
    facts = SassFacts()
    wide_at: list[int] = []
    scalar_at: list[int] = []
    half_at: list[int] = []  # 64-bit
    loads: list[tuple[int, int]] = []  # (address, bytes) of every global load
    for ins in instrs:
        head = ins.op.split(".")[0]
        if head in ("LDL", "STL"):
            facts.local_ops += 1
        kind = global_access(ins.op)
        if kind is None:
            continue
        bits = access_bits(ins.op)
        wide = bits >= 128
        if kind == "load":
            loads.append((ins.addr, bits // 8))
        (wide_at if wide else half_at if bits == 64 else scalar_at).append(ins.addr)
        if kind == "load":
            facts.loads_128 += wide
            facts.scalar_loads += not wide
        else:
            facts.stores_128 += wide
            facts.scalar_stores += not wide
    vector_loops = [lp for lp in loops(instrs) if any(lp[0] <= a <= lp[1] for a in wide_at)]
    innermost = [
        lp for lp in vector_loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in vector_loops)
    ]
    facts.hot_loops = len(innermost)
    facts.hot_loop_scalar = [sum(lo <= a <= hi for a in scalar_at) for lo, hi in innermost]
    facts.hot_loop_64 = [sum(lo <= a <= hi for a in half_at) for lo, hi in innermost]
    facts.hot_loop_load_bytes = [sum(b for a, b in loads if lo <= a <= hi) for lo, hi in innermost]
    return facts
