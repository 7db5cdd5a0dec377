#!/usr/bin/env bash
# One command to set up gradacc_ext and run it.
#
#   ./scripts/quickstart.sh demo [demo flags]   set up, then run `gradacc demo`
#   ./scripts/quickstart.sh test [pytest args]  set up, then run the CUDA compile
#                                               check and the kernel report (if nvcc
#                                               exists), ruff and pytest
#
# Setup = a virtual environment ($GRADACC_VENV, default .venv) with torch
# ($GRADACC_TORCH, default torch==2.13.0, the CPU build), then
# `pip install --no-build-isolation -e .[test,plot]`, which builds the
# extension against that torch (CUDA kernels too when torch is a CUDA build
# and nvcc is found). Re-running reuses the environment, and skips the install
# while scripts/build_stamp.py's fingerprint (C++ sources, build files, torch,
# switches, the built library) matches the one stored after the last install.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: $0 {demo|test} [args...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
mode=$1; shift
case "$mode" in demo|test) ;; *) usage ;; esac

venv=${GRADACC_VENV:-.venv}
torch_spec=${GRADACC_TORCH:-torch==2.13.0}
py="$venv/bin/python"

if [ ! -x "$py" ]; then
  echo "== creating virtual environment $venv"
  python3 -m venv "$venv"
fi
stamp_file="$venv/.gradacc-build-stamp"
if [ -f "$stamp_file" ] && [ "$("$py" scripts/build_stamp.py)" = "$(cat "$stamp_file")" ]; then
  echo "== gradacc_ext is up to date in $venv (nothing to rebuild)"
else
  rm -f "$stamp_file"  # an interrupted install must not look finished
  # The stock pip 23.2 cannot do editable installs with setuptools >= 80.
  "$py" -m pip install -q --upgrade pip setuptools wheel ninja
  if ! "$py" -c "import torch" 2>/dev/null; then
    echo "== installing $torch_spec"
    "$py" -m pip install -q "$torch_spec"
  fi
  echo "== building gradacc_ext against $("$py" -c 'import torch; print("torch", torch.__version__)')"
  "$py" -m pip install -q --no-build-isolation -e ".[test,plot,dev]"
  "$py" scripts/build_stamp.py >"$stamp_file"
fi

if [ "$mode" = demo ]; then
  exec "$venv/bin/gradacc" demo "$@"
fi

if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "== CUDA compile check (sm_80, sm_90, sm_100)"
  kernel_objects=$(mktemp -d)
  trap 'rm -rf "$kernel_objects"' EXIT
  PATH="$(dirname "$py"):$PATH" bash scripts/check_cuda_compile.sh --keep "$kernel_objects"
  # the same objects' SASS: spills, local memory, 128-bit accesses, occupancy (docs/kernel-report.md)
  echo "== kernel report (scripts/kernel_report.py --check)"
  report_start=$(date +%s)
  "$py" scripts/kernel_report.py --objects "$kernel_objects" --check
  echo "kernel report took $(($(date +%s) - report_start)) s"
  rm -rf "$kernel_objects"
else
  echo "== CUDA compile check and kernel report skipped: no nvcc on this machine"
fi
echo "== ruff"
"$venv/bin/ruff" check gradacc_ext tests benchmarks
echo "== pytest"
exec "$py" -m pytest tests -q "$@"
