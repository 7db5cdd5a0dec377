#!/usr/bin/env bash
# Loads each wheel's _C in a real older-glibc userland: a Debian root tree made by debootstrap, entered by chroot.
#
#   scripts/old_glibc_load.sh --torch-lib DIR [--root DIR] [--suite bullseye] WHEEL [WHEEL ...]
#
# --torch-lib: a manylinux_2_28 torch's lib folder (libc10.so, libtorch_cpu.so, libgomp.so.1; PyPI's torch
# wheels are manylinux_2_28). --root: where the root tree lives, made on the first run and reused (default
# /tmp/gradacc-glibc-<suite>, about 250 MB). --suite: the Debian release; the oldest that Debian's package
# servers still carry is bullseye (glibc 2.31; buster's 2.28 has left them).
#
# Inside the root, the distribution's own python3 loads torch's libraries and then _C with RTLD_NOW: every
# symbol must resolve and every symbol version must exist in that glibc, and _C's static initialisers run
# (they register the ops with torch's dispatcher). bullseye's Python is 3.9, older than torch 2.11 and the
# abi3 wheels need, so no Python code of torch or gradacc runs there: this checks the binary, not the suite.
# Needs root (chroot) and debootstrap (apt-get install debootstrap). Exit 1 names a _C that does not load.
set -euo pipefail
suite=bullseye
root=""
torch_lib=""
wheels=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --torch-lib) torch_lib="$2"; shift 2 ;;
    --root) root="$2"; shift 2 ;;
    --suite) suite="$2"; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    -*) echo "error: unknown option '$1' (expected --torch-lib DIR, --root DIR, --suite NAME)" >&2; exit 2 ;;
    *) wheels+=("$1"); shift ;;
  esac
done
root="${root:-/tmp/gradacc-glibc-$suite}"
[[ ${#wheels[@]} -gt 0 ]] || { echo "error: name at least one wheel" >&2; exit 2; }
[[ -f $torch_lib/libtorch_cpu.so ]] || { echo "error: --torch-lib '$torch_lib' holds no libtorch_cpu.so" >&2; exit 2; }
command -v debootstrap >/dev/null || { echo "error: debootstrap not found (apt-get install debootstrap)" >&2; exit 2; }

if [[ ! -x $root/usr/bin/python3 ]]; then
  echo "making a $suite root in $root (debootstrap, minbase + python3)"
  rm -rf "$root"
  debootstrap --variant=minbase --include=python3 "$suite" "$root" http://deb.debian.org/debian >"$root.log" 2>&1 ||
    { tail -n 20 "$root.log"; echo "error: debootstrap $suite failed (log: $root.log)" >&2; exit 1; }
fi
echo "root: $root, $(chroot "$root" ldd --version | head -n1)"

lib="$root/opt/gradacc"
rm -rf "$lib" && mkdir -p "$lib"
cp "$torch_lib"/libc10.so "$torch_lib"/libtorch_cpu.so "$torch_lib"/libgomp*.so* "$lib/"
inside=()
for wheel in "${wheels[@]}"; do
  name="$(basename "$wheel" .whl)"
  mkdir -p "$lib/$name"
  python3 - "$wheel" "$lib/$name" <<'EOF'
import pathlib, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    for member in wheel.namelist():
        if member.startswith("gradacc_ext/_C") and member.endswith(".so"):
            (pathlib.Path(sys.argv[2]) / pathlib.Path(member).name).write_bytes(wheel.read(member))
EOF
  inside+=("/opt/gradacc/$name/$(basename "$(ls "$lib/$name"/_C*.so)")")
done
cat >"$lib/load.py" <<'EOF'
import ctypes
import os
import sys

ctypes.CDLL("/opt/gradacc/libtorch_cpu.so", mode=os.RTLD_NOW | ctypes.RTLD_GLOBAL)
try:
    ctypes.CDLL(sys.argv[1], mode=os.RTLD_NOW)
except OSError as error:
    sys.exit(f"FAILED: {error}")
print("loaded (RTLD_NOW, static initialisers ran):", sys.argv[1])
EOF
# One process per _C: each registers the same ops with torch's dispatcher, which refuses a second set.
failed=0
for so in "${inside[@]}"; do
  chroot "$root" env LD_LIBRARY_PATH=/opt/gradacc python3 /opt/gradacc/load.py "$so" || failed=1
done
exit "$failed"
