"""What the compiled CUDA kernels look like, before any GPU runs them (issue 31, section 2).

    python scripts/kernel_report.py [--objects DIR] [--out FILE.md] [--check]

For every kernel instantiation of csrc/cuda/*.cu, for sm_80, sm_90 and sm_100: registers per thread,
spill stores and loads, stack frame, static shared memory (nvcc's `-Xptxas -v` log); the theoretical
occupancy at the launch's block size (scripts/kernel_occupancy.py's table); 128-bit global loads and
stores, the scalar global accesses in the vectorised hot loop and any local-memory instruction
(`cuobjdump -sass`, scripts/kernel_sass.py). With --out, also the predicted time of the headline
kernels on an H100 and an H200 (scripts/kernel_predictions.py).

--objects DIR reuses what `scripts/check_cuda_compile.sh --keep DIR` left (each .cu's object and
ptxas log); without it the script runs that compile check itself. cuobjdump comes from
scripts/cuda_tools.sh (installed into this interpreter's environment when missing), or --tools DIR.

--check exits 1 when a kernel breaks a rule: any spill, stack frame or local-memory instruction; a
kernel of VECTORISED without 128-bit loads (and stores, where it stores); occupancy below
OCCUPANCY_FLOOR, unless one block per SM keeps IN_FLIGHT_FLOOR bytes of loads in flight.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kernel_occupancy import ARCHS, Occupancy, occupancy
from kernel_report_md import predictions, predictions_json, render
from kernel_sass import Resources, SassFacts, analyse, parse_ptxas_log, parse_sass

ROOT = Path(__file__).resolve().parents[1]
# csrc/cuda/<name>.cu, every one, as check_cuda_compile.sh compiles them
SOURCES = tuple(sorted(p.stem for p in (ROOT / "csrc/cuda").glob("*.cu")))
# Every launch's block size must be this constant (launch_block_threads checks the launchers).
BLOCK_CONSTANT = "kBlockThreads"
# The kernels with a 16-byte path, and whether they store (then 128-bit stores are required too).
# norm_kernel<float, false> and <double, false> read one element at a time by design (norm.cuh).
VECTORISED = {"accumulate_kernel": True, "scale_kernel": True, "optim_kernel": True, "norm_kernel<float, true>": False}
# Occupancy, at least: two resident blocks (50% at 512 threads), so that one block's prologue (the
# slot search, the dtype dispatch), barriers (the norm's block reduction) and tail overlap another
# block's streaming. One block (25%) passes only when its hot loop alone keeps IN_FLIGHT_FLOOR bytes
# of loads in flight per SM (resident threads x the bytes one iteration of the poorest hot loop
# loads): Little's law asks ~29 KB per SM on an H200 (4.8 TB/s x ~0.8 us loaded DRAM latency / 132
# SMs) and ~20 KB on an H100. See docs/kernel-report.md.
OCCUPANCY_FLOOR = 50.0
ONE_BLOCK_FLOOR = 25.0
IN_FLIGHT_FLOOR = 32 * 1024
RULES = (
    "no spill, stack frame or local-memory instruction (LDL/STL); 128-bit global loads (and stores where it "
    f"stores) in every vectorised kernel ({', '.join(f'`{v}`' for v in VECTORISED)}); occupancy >= "
    f"{OCCUPANCY_FLOOR:.0f}% (two blocks per SM), or >= {ONE_BLOCK_FLOOR:.0f}% (one block) where the poorest hot "
    f"loop keeps >= {IN_FLIGHT_FLOOR // 1024} KB of loads in flight per SM"
)
# Enum template arguments as words: the scale kernels' modes, the optimizer kernel's state storages.
ENUM_WORDS = {"(gradacc::ScaleMode)0": "unscale", "(gradacc::ScaleMode)1": "clip_norm",
              "(gradacc::ScaleMode)2": "clip_value", "(gradacc::StateStorage)0": "fp32",
              "(gradacc::StateStorage)1": "bf16", "(gradacc::StateStorage)2": "int8"}  # fmt: skip


@dataclass
class Kernel:
    name: str  # short, demangled: accumulate_kernel<true, false>
    arch: str
    res: Resources
    sass: SassFacts
    occ: Occupancy
    in_flight: int  # bytes of loads in flight per SM in the poorest hot loop (0: no hot loop)
    problems: list[str]


def launch_block_threads() -> int:
    """kBlockThreads, after checking that every <<<grid, block, ...>>> in csrc/cuda/ passes it."""
    m = re.search(rf"constexpr int {BLOCK_CONSTANT} = (\d+);", (ROOT / "csrc/kernels/multi_tensor.cuh").read_text())
    if not m:
        raise SystemExit(f"kernel_report: no `constexpr int {BLOCK_CONSTANT}` in csrc/kernels/multi_tensor.cuh")
    for cu in sorted((ROOT / "csrc/cuda").glob("*.cu")):
        for launch in re.findall(r"<<<([^>]*)>>>", cu.read_text()):
            block = launch.split(",")[1].strip()
            if block != BLOCK_CONSTANT:
                raise SystemExit(f"kernel_report: {cu.name} launches with block size '{block}', not {BLOCK_CONSTANT}:"
                                 " teach launch_block_threads() that launch's block size")  # fmt: skip
    return int(m.group(1))


def short_name(demangled: str) -> str:
    """`void gradacc::cuda::norm_kernel<float, true>(gradacc::cuda::ListMeta<1>, ...)` -> `norm_kernel<float, true>`."""
    depth, cut = 0, len(demangled)
    for i, ch in enumerate(demangled):  # the argument list: the first '(' outside the template arguments
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth == 0:
            cut = i
            break
    name = demangled[:cut].removeprefix("void ").replace("gradacc::cuda::", "")
    for mode, word in ENUM_WORDS.items():
        name = name.replace(mode, word)
    return name.replace("gradacc::", "").strip()


def demangle(names: list[str]) -> dict[str, str]:
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return dict(zip(names, (short_name(d) for d in out.splitlines()), strict=True))


def tool_release(version_text: str) -> str:
    """`cuobjdump 13.2.86` from `cuobjdump --version`'s `Cuda compilation tools, release 13.2, V13.2.86`."""
    m = re.search(r"V(\d+\.\d+\.\d+)", version_text)
    return f"cuobjdump {m.group(1)}" if m else "cuobjdump (unknown version)"


def compile_objects(into: Path) -> None:
    cmd = ["bash", str(ROOT / "scripts/check_cuda_compile.sh"), "--keep", str(into)]
    # the compile check asks `python` for torch's headers and flags: this interpreter's
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if subprocess.run(cmd, env=env).returncode != 0:
        raise SystemExit("kernel_report: scripts/check_cuda_compile.sh failed (above)")


def cuobjdump(tools: Path | None) -> Path:
    if tools is None:
        out = subprocess.run(
            ["bash", str(ROOT / "scripts/cuda_tools.sh"), sys.executable], capture_output=True, text=True
        )
        if out.returncode != 0:
            raise SystemExit(f"kernel_report: scripts/cuda_tools.sh failed: {out.stderr.strip()}")
        tools = Path(out.stdout.strip())
    return tools / "cuobjdump"


def loads_in_flight(sass: SassFacts, occ: Occupancy, block: int) -> int:
    """Bytes of global loads one SM has in flight in the poorest hot loop: resident threads x its loads."""
    return min(sass.hot_loop_load_bytes, default=0) * occ.blocks * block


def problems_of(name: str, res: Resources, sass: SassFacts, occ: Occupancy, block: int) -> list[str]:
    found = []
    if res.spill_stores or res.spill_loads:
        found.append(f"spills {res.spill_stores}/{res.spill_loads} B")
    if res.stack_frame:
        found.append(f"{res.stack_frame} B stack frame")
    if sass.local_ops:
        found.append(f"{sass.local_ops} local-memory instructions")
    for family, stores in VECTORISED.items():
        if name.startswith(family):
            if not sass.loads_128 or (stores and not sass.stores_128):
                found.append("vectorised kernel without 128-bit " + ("loads" if not sass.loads_128 else "stores"))
    in_flight = loads_in_flight(sass, occ, block)
    if occ.percent < OCCUPANCY_FLOOR and not (occ.percent >= ONE_BLOCK_FLOOR and in_flight >= IN_FLIGHT_FLOOR):
        found.append(f"occupancy {occ.percent:.0f}% < {OCCUPANCY_FLOOR:.0f}% ({occ.limiter}), "
                     f"{in_flight // 1024} KB of loads in flight per SM")  # fmt: skip
    return found


def collect(objects: Path, tool: Path, block: int) -> list[Kernel]:
    kernels = []
    for src in SOURCES:
        obj, log = objects / f"{src}.o", objects / f"{src}.ptxas.log"
        if not obj.exists() or not log.exists():
            raise SystemExit(f"kernel_report: {obj} or {log} missing (scripts/check_cuda_compile.sh --keep DIR)")
        resources = parse_ptxas_log(log.read_text())
        sass = parse_sass(
            subprocess.run([str(tool), "-sass", str(obj)], capture_output=True, text=True, check=True).stdout
        )
        if set(sass) != set(resources):
            raise SystemExit(f"kernel_report: {src}: the SASS and the ptxas log name different kernels")
        names = demangle(sorted({k for _, k in sass}))
        for arch, mangled in sorted(sass, key=lambda k: (names[k[1]], int(k[0][3:]))):
            res, facts = resources[(arch, mangled)], analyse(sass[(arch, mangled)])
            occ = occupancy(ARCHS[arch], res.registers, res.static_smem, block)
            name = names[mangled]
            in_flight = loads_in_flight(facts, occ, block)
            kernels.append(Kernel(name, arch, res, facts, occ, in_flight, problems_of(name, res, facts, occ, block)))
    missing = set(ARCHS) - {k.arch for k in kernels}
    if missing:
        raise SystemExit(f"kernel_report: no kernels for {sorted(missing)} in the objects (compiled for other archs?)")
    return kernels


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objects", type=Path, help="check_cuda_compile.sh --keep's folder (default: compile now)")
    p.add_argument("--tools", type=Path, help="the folder holding cuobjdump (default: scripts/cuda_tools.sh's)")
    p.add_argument("--out", type=Path, help="write the Markdown report, with the predicted GPU times, to FILE.md "
                   "and the predictions to FILE.json (scripts/gpu_verify_model.py reads them)")  # fmt: skip
    p.add_argument("--check", action="store_true", help="exit 1 if a kernel breaks a rule")
    args = p.parse_args(argv)
    block = launch_block_threads()
    tool = cuobjdump(args.tools)
    with tempfile.TemporaryDirectory() as tmp:
        objects = args.objects or Path(tmp)
        if args.objects is None:
            compile_objects(objects)
        kernels = collect(objects, tool, block)
        version = subprocess.run([str(tool), "--version"], capture_output=True, text=True).stdout
    preds = predictions(kernels) if args.out else None
    text = render(kernels, block, RULES, tool_version=tool_release(version), preds=preds)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(predictions_json(preds), indent=1) + "\n")
    bad = [k for k in kernels if k.problems]
    where = f"; report: {args.out}" if args.out else ""
    print(
        f"kernel_report: {len(kernels)} kernel instantiations x arch, block {block} threads, "
        f"occupancy floor {OCCUPANCY_FLOOR:.0f}%: {len(bad)} break a rule{where}"
    )
    for k in bad:
        print(f"  FAIL {k.arch:6s} {k.name}: {'; '.join(k.problems)}")
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
