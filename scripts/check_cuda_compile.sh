#!/usr/bin/env bash
# Compile check of the CUDA sources on a machine without a GPU (CI).
#
#   1. every csrc/cuda/*.cu (kernels.cu, optim_kernels.cu) with nvcc for sm_80, sm_90 and sm_100 (the
#      wheel's A100, H100/H200 and B200 machine code), with the flags torch's CUDAExtension adds
#      (setup.py builds it that way). Every nvcc and ptxas warning is an error, including
#      register spills and local-memory use (a 32 KB by-value metadata struct must never land in
#      local memory). ptxas's resource report (-v) goes to <name>.ptxas.log beside the object.
#   2. csrc/cuda/register_cuda.cpp, register_optim_cuda.cpp and stream.cpp (host C++) against the installed torch's
#      headers, syntax only, as setup.py builds them: LibTorch stable ABI only, targeting torch 2.11
#      (TORCH_TARGET_VERSION), with USE_CUDA for the C shim's CUDA stream call. They include no
#      c10/cuda header, so a CPU-only torch wheel's headers suffice.
#
# Usage: scripts/check_cuda_compile.sh [--keep DIR]   (NVCC=/path/to/nvcc to pick nvcc;
# `python` is the active environment's, with torch installed). --keep DIR keeps each .cu's object
# and ptxas log in DIR, for scripts/kernel_report.py --objects DIR.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KEEP=""
if [[ "${1:-}" == "--keep" ]]; then
  KEEP="${2:?--keep needs a folder}"
  mkdir -p "$KEEP"
elif [[ $# -gt 0 ]]; then
  echo "usage: $0 [--keep DIR]" >&2
  exit 2
fi
if [[ -z "${NVCC:-}" ]]; then
  if command -v nvcc >/dev/null 2>&1; then NVCC="$(command -v nvcc)"; else NVCC=/usr/local/cuda/bin/nvcc; fi
fi
[[ -x "$NVCC" ]] || { echo "error: nvcc not found (set NVCC=/path/to/nvcc)" >&2; exit 1; }
# The toolkit's headers, as nvcc itself finds them (nvcc may be a wrapper script).
CUDA_INCLUDE="$(bash "$ROOT/scripts/cuda_home.sh" "$NVCC")/include"
[[ -f "$CUDA_INCLUDE/cuda_runtime_api.h" ]] || { echo "error: no CUDA headers in $CUDA_INCLUDE" >&2; exit 1; }
CXX="${CXX:-g++}"

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
OBJ="${KEEP:-$TMP}"

timed() {  # timed LABEL CMD...: runs CMD, prints LABEL and its wall time
  local label="$1" start end
  shift
  start=$(date +%s%N)
  "$@"
  end=$(date +%s%N)
  printf '  ok  %-60s %6d ms\n' "$label" "$(((end - start) / 1000000))"
}

# torch's header dirs ("I <dir>") and the nvcc flags its CUDAExtension adds ("F <flag>").
TORCH_INFO="$(python -c "from torch.utils import cpp_extension as c
print('\n'.join(['I ' + p for p in c.include_paths()] + ['F ' + f for f in c.COMMON_NVCC_FLAGS]))")"
mapfile -t TORCH_INCLUDES < <(sed -n 's/^I //p' <<<"$TORCH_INFO")
mapfile -t TORCH_NVCC_FLAGS < <(sed -n 's/^F //p' <<<"$TORCH_INFO")

echo "nvcc: $NVCC ($("$NVCC" --version | grep -o 'release [0-9.]*'))"
nvcc_cu() {  # nvcc_cu NAME: compiles csrc/cuda/NAME.cu into $OBJ; ptxas's report in NAME.ptxas.log, shown on failure
  if ! "$NVCC" -c "$ROOT/csrc/cuda/$1.cu" -o "$OBJ/$1.o" -std=c++17 -O3 -DGRADACC_WITH_CUDA \
    "${TORCH_NVCC_FLAGS[@]}" -Xcompiler -fPIC \
    -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -gencode arch=compute_100,code=sm_100 \
    -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror \
    -Xptxas -v,-warn-spills,-warn-lmem-usage,-Werror 2>"$OBJ/$1.ptxas.log"; then
    grep -v '^ptxas info\|^    [0-9]* bytes stack frame' "$OBJ/$1.ptxas.log" >&2
    return 1
  fi
}
for path in "$ROOT"/csrc/cuda/*.cu; do  # every .cu: a new kernel file is checked (and reported) as it lands
  cu="$(basename "$path" .cu)"
  timed "csrc/cuda/$cu.cu (nvcc, sm_80 + sm_90 + sm_100)" nvcc_cu "$cu"
done

STABLE_TARGET=0x020b000000000000  # torch 2.11: setup.py's STABLE_TARGET_HEX
for reg in register_cuda register_optim_cuda stream; do
  timed "csrc/cuda/$reg.cpp ($CXX -fsyntax-only, torch headers)" \
    "$CXX" -fsyntax-only -std=c++17 -DGRADACC_WITH_CUDA -DUSE_CUDA -DTORCH_TARGET_VERSION="$STABLE_TARGET" \
    -Wall -Wextra -Werror "${TORCH_INCLUDES[@]/#/-isystem}" -isystem "$CUDA_INCLUDE" \
    "$ROOT/csrc/cuda/$reg.cpp"
done
echo "CUDA compile check passed"
