"""Fails unless a CUDA wheel's _C holds exactly the GPU code its arch list promises.

    python scripts/check_wheel_archs.py --cuobjdump PATH WHEEL [--expect "7.5;8.0;9.0+PTX"]

Reads the device code in the wheel's _C with `cuobjdump --list-elf` (the SASS binaries, one per arch and
source file) and `--list-ptx` (the PTX), and compares them with the arch list: --expect, else the one the
wheel records in gradacc_ext/_build_config.py (setup.py's default for its CUDA toolkit, docs/install.md,
"GPU architectures"). "X.Y" wants an sm_XY binary; "+PTX" on the last also wants compute_XY PTX, and no
other PTX may be there. Prints the archs found. cuobjdump: scripts/cuda_tools.sh prints its folder.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def expected(arch_list: str) -> tuple[set[str], set[str]]:
    """({"sm_75", ...}, {"sm_120"}) for "7.5;...;12.0+PTX": the SASS archs and the PTX archs a list asks for."""
    sass, ptx = set(), set()
    for item in arch_list.replace(" ", ";").split(";"):
        if not item:
            continue
        arch = "sm_" + item.removesuffix("+PTX").replace(".", "")
        sass.add(arch)
        if item.endswith("+PTX"):
            ptx.add(arch)
    return sass, ptx


def found(cuobjdump: str, so: Path, what: str) -> set[str]:
    """The archs of the ELF (what="elf") or PTX (what="ptx") entries in so."""
    listing = subprocess.run([cuobjdump, f"--list-{what}", str(so)], capture_output=True, text=True)
    if listing.returncode != 0 and "file found" not in listing.stderr:  # "No PTX file found ...": none
        raise SystemExit(f"error: {cuobjdump} --list-{what} {so} failed: {listing.stderr.strip()}")
    return set(re.findall(r"\.(sm_\d+a?)\.(?:cubin|ptx)", listing.stdout))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuobjdump", required=True, help="the cuobjdump binary")
    parser.add_argument("--expect", help="the arch list to hold (default: the wheel's recorded arch_list)")
    parser.add_argument("wheel", type=Path)
    args = parser.parse_args()
    with zipfile.ZipFile(args.wheel) as wheel, tempfile.TemporaryDirectory() as tmp:
        names = wheel.namelist()
        so_name = next((n for n in names if re.fullmatch(r"gradacc_ext/_C[^/]*\.so", n)), None)
        if so_name is None:
            raise SystemExit(f"error: {args.wheel} holds no gradacc_ext/_C*.so")
        config = ast.literal_eval(wheel.read("gradacc_ext/_build_config.py").decode().split("BUILD_CONFIG = ", 1)[1])
        so = Path(wheel.extract(so_name, tmp))
        arch_list = args.expect or config.get("arch_list")
        if not arch_list:
            raise SystemExit(f"error: {args.wheel} records no arch list (a CPU wheel?) and --expect is not given")
        want_sass, want_ptx = expected(arch_list)
        have_sass, have_ptx = found(args.cuobjdump, so, "elf"), found(args.cuobjdump, so, "ptx")
    print(f"{args.wheel.name}: CUDA {config.get('cuda_version')}, arch list {arch_list}")
    print(f"  SASS: {' '.join(sorted(have_sass, key=lambda a: int(a[3:].rstrip('a'))))}")
    print(f"  PTX:  {' '.join(sorted(have_ptx)) or '-'}")
    if (have_sass, have_ptx) != (want_sass, want_ptx):
        print(f"error: expected SASS {sorted(want_sass)} and PTX {sorted(want_ptx)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
