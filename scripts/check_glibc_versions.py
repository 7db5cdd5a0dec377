"""Fails if a shared object needs a glibc / libstdc++ / libgcc symbol version newer than a manylinux tag allows.

    python scripts/check_glibc_versions.py [--tag manylinux_2_28] [--wheel WHEEL] FILE.so [FILE.so ...]

Reads `objdump -T` (the dynamic symbols and the versions they are bound to) and compares each versioned
reference with the newest version the tag allows: PEP 600's manylinux_2_28 is glibc 2.28 with gcc 8's
libstdc++ and libgcc, as auditwheel's policy lists them. Exit 1 names every symbol past its limit; exit 0
prints the newest version used per family. scripts/build_wheels.sh runs it on each wheel's _C, so a new
glibc function that the pins (csrc/compat/) do not cover fails the build instead of narrowing the wheel.
--wheel also asks `auditwheel show --json` (run by this Python): the tag its symbol versions allow must be the
tag or lower, and the only libraries outside the manylinux set torch's own (libc10.so, libtorch_cpu.so: the
user's torch provides them, so auditwheel's overall verdict is linux_x86_64 for any wheel that names them).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

# The newest version of each family a tag allows (auditwheel's policy/manylinux-policy.json, x86_64).
LIMITS = {
    "manylinux_2_28": {"GLIBC": "2.28", "GLIBCXX": "3.4.24", "CXXABI": "1.3.11", "GCC": "7.0.0"},
}
TORCH_LIBS = {"libc10.so", "libtorch_cpu.so"}
VERSIONED = re.compile(r"\(?\b(GLIBC|GLIBCXX|CXXABI|GCC)_([0-9][0-9.]*)\)?\s+(\S+)$")


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def versioned_symbols(path: str) -> list[tuple[str, str, str]]:
    """(family, version, symbol) for every dynamic symbol bound to a GLIBC/GLIBCXX/CXXABI/GCC version."""
    dump = subprocess.run(["objdump", "-T", path], capture_output=True, text=True, check=True).stdout
    found = (VERSIONED.search(line) for line in dump.splitlines())
    return [(m.group(1), m.group(2), m.group(3)) for m in found if m]


def auditwheel_verdict(wheel: str, tag: str) -> list[str]:
    """The errors in auditwheel's view of wheel (none: it fits tag); prints its symbol-version tag."""
    shown = subprocess.run(
        [sys.executable, "-m", "auditwheel", "show", "--json", wheel], capture_output=True, text=True
    )
    if shown.returncode != 0:
        return [f"auditwheel show {wheel} failed: {shown.stderr.strip()}"]
    report = json.loads(shown.stdout)
    sym_tag, external = report["sym_tag"], set(report["external_libs"])
    print(f"{wheel}: auditwheel show: symbol versions allow {sym_tag}; external libraries {sorted(external)}")
    errors = []
    found = re.fullmatch(r"manylinux_2_(\d+)_x86_64", sym_tag)
    if found is None or int(found.group(1)) > int(tag.split("_")[2]):
        errors.append(f"auditwheel places the symbol versions at {sym_tag}, above {tag}")
    if external - TORCH_LIBS:
        errors.append(f"libraries outside the manylinux set besides torch's: {sorted(external - TORCH_LIBS)}")
    return errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tag", default="manylinux_2_28", choices=sorted(LIMITS), help="the manylinux tag")
    parser.add_argument("--wheel", help="also check auditwheel's verdict on this wheel")
    parser.add_argument("files", nargs="+", help="shared objects to check (e.g. an unpacked wheel's _C*.so)")
    args = parser.parse_args()
    limits = LIMITS[args.tag]
    failed = False
    for path in args.files:
        symbols = versioned_symbols(path)
        if not symbols:
            print(f"error: {path}: objdump -T shows no versioned glibc symbol (not a glibc ELF object?)")
            failed = True
            continue
        over = sorted(
            {(f, v, s) for f, v, s in symbols if _key(v) > _key(limits[f])}, key=lambda t: (t[0], _key(t[1]), t[2])
        )
        for family, version, symbol in over:
            print(f"error: {path}: {symbol} needs {family}_{version}, above {args.tag}'s {family}_{limits[family]}")
        newest = {f: max((v for g, v, _ in symbols if g == f), key=_key) for f in sorted({f for f, _, _ in symbols})}
        verdict = "FAILS" if over else "fits"
        print(f"{path}: {verdict} {args.tag}; newest used: " + ", ".join(f"{f}_{v}" for f, v in newest.items()))
        failed |= bool(over)
    for error in auditwheel_verdict(args.wheel, args.tag) if args.wheel else []:
        print(f"error: {args.wheel}: {error}")
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
