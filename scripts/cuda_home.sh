#!/usr/bin/env bash
# Prints the CUDA toolkit's root as nvcc itself finds it: the folder of its headers and tools.
#
#   scripts/cuda_home.sh [NVCC]     (default: $NVCC, the nvcc on PATH, /usr/local/cuda/bin/nvcc)
#
# torch takes CUDA_HOME as the folder above `which nvcc`; when nvcc is a wrapper script outside the
# toolkit (/usr/local/bin/nvcc -> exec /usr/local/cuda-13.0/bin/nvcc), that guess has no headers
# and the build fails. nvcc's --dryrun prints its TOP, the real root. Exit 1 if there is no nvcc.
set -euo pipefail
nvcc="${1:-${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}}"
[[ -x "$nvcc" ]] || { echo "error: nvcc not found (set NVCC=/path/to/nvcc)" >&2; exit 1; }
top="$("$nvcc" --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=\(.*\)$/\1/p' | head -n1)"
[[ -n "$top" ]] || { echo "error: $nvcc --dryrun printed no TOP" >&2; exit 1; }
cd "$top" && pwd -P
