#!/usr/bin/env bash
# Measures what each candidate TORCH_CUDA_ARCH_LIST costs: nvcc wall time and
# the size of csrc/cuda/kernels.cu's object (the only arch-dependent part of
# the extension; the C++ sources compile once whatever the list). Used to
# pick setup.py's DEFAULT_ARCH_LIST (docs/install.md, "GPU architectures").
#
# Usage: scripts/measure_arch_lists.sh ["LIST" ...]   (NVCC=... to pick nvcc)
# Each LIST uses TORCH_CUDA_ARCH_LIST syntax: "7.5;8.0;9.0+PTX".
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
if [[ $# -eq 0 ]]; then
  set -- "8.0;9.0+PTX" "7.5;8.0;8.6;8.9;9.0+PTX" "7.5;8.0;8.6;8.9;9.0;10.0;12.0+PTX" "8.0;9.0;10.0;12.0+PTX"
fi
mapfile -t TORCH_FLAGS < <(python -c "from torch.utils import cpp_extension as c; print('\n'.join(c.COMMON_NVCC_FLAGS))")
mapfile -t INCLUDES < <(python -c "from torch.utils import cpp_extension as c; print('\n'.join(c.include_paths()))")

gencode() {  # TORCH_CUDA_ARCH_LIST syntax -> nvcc -gencode flags (as torch's _get_cuda_arch_flags does)
  local arch num
  for arch in ${1//;/ }; do
    num="${arch%+PTX}"
    num="${num//./}"
    echo "-gencode=arch=compute_${num},code=sm_${num}"
    [[ "$arch" == *+PTX ]] && echo "-gencode=arch=compute_${num},code=compute_${num}"
  done
  return 0
}

echo "nvcc: $("$NVCC" --version | grep -o 'release [0-9.]*'); host: $(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg)"
# cpu_s (user + system of nvcc and its children) is what a build costs; wall_s depends on the load.
printf '%-40s %8s %8s %12s\n' "TORCH_CUDA_ARCH_LIST" "cpu_s" "wall_s" "object_KiB"
TIMEFORMAT='%U %S %R'
for list in "$@"; do
  mapfile -t GEN < <(gencode "$list")
  read -r user sys wall < <({ time "$NVCC" -c "$ROOT/csrc/cuda/kernels.cu" -o "$TMP/k.o" -std=c++17 -O3 \
    -DGRADACC_WITH_CUDA -Xcompiler -fPIC "${TORCH_FLAGS[@]}" "${INCLUDES[@]/#/-I}" "${GEN[@]}" 2>/dev/null; } 2>&1)
  printf '%-40s %8.1f %8.1f %12d\n' "$list" "$(echo "$user + $sys" | bc -l)" "$wall" "$(($(stat -c %s "$TMP/k.o") / 1024))"
done
