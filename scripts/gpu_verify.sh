#!/usr/bin/env bash
# One-call verification on a GPU machine (README, "Verifying on a GPU").
#
#   scripts/gpu_verify.sh [--out DIR] [--dry-run]
#
# 1. env         device, driver, torch, nvcc, commit, date -> DIR/env.json
# 2. build       the extension for this GPU's arch only (TORCH_CUDA_ARCH_LIST=<its capability>)
# then, in parallel (16 cores, one GPU; none of them is timed):
# 3. tests       the full test suite with the CUDA kernels required (GRADACC_REQUIRE_EXT=1)
# 4. gpu_checks  tests/gpu/test_gpu_checks.py: a whole window in a CUDA graph, a window under
#                torch.cuda.set_sync_debug_mode("error") (plain and fused AdamW/SGD tails; the accumulator's
#                fused window), one >2^31-element tensor through every op and both optimizer steps
# 5. memcheck    compute-sanitizer memcheck on the op tests' CUDA cases (the optimizer steps' included)
# 6. racecheck   compute-sanitizer racecheck on scripts/gpu_smoke_ops.py (every op and adamw/sgd, every layout)
# then alone, one after the other (timed):
# 7. bench_step, bench_step_1.3b   benchmarks/fused_step.py --device cuda: the fused optimizer step against
#                torch (issue 10's GPU targets), gpt2-small at full size and gpt-1.3b at half size
# 8. bench       benchmarks/compare.py: time and peak memory against torch eager and torch.compile
# results under benchmarks/results/ and DIR (device, torch, commit, date in each file)
#
# Each step has a time limit and the whole run a budget (GPU_VERIFY_BUDGET_S, default 570 s) so
# it ends within 10 minutes on an H100 with 16 cores (limits: env 30, build 180, the parallel four
# 200, bench_step 45 each, bench 170 or what is left); a step past its limit is recorded as
# "timeout". Logs go to DIR/<step>.log, the record to DIR/summary.{json,md}, with issue 10's
# targets from the fused-step runs. Exit status 0 only if every step passed.
#
# --dry-run works on a machine without a GPU (CI runs it, tests/gpu/test_gpu_verify.py): it prints
# the plan, checks that every file and tool the plan names is there, and runs the CPU-runnable
# pieces (env, the smoke script on the CPU, tiny CPU runs of both benchmarks into DIR, the GPU
# benchmark's arguments parsed). It never builds and never writes benchmarks/results/.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
DRY=0
OUT=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUT="${2:?--out needs a folder}"; shift ;;
    -h | --help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "gpu_verify.sh: unknown argument '$1' (expected --out DIR, --dry-run)" >&2; exit 2 ;;
  esac
  shift
done
OUT="${OUT:-gpu_verify_out/$(date -u +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the in-place build, for the scripts and the tests
BUDGET_S="${GPU_VERIFY_BUDGET_S:-570}"
START_S=$(date +%s)
JOBS="$(nproc)"
SANITIZER="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"
OP_TESTS=(tests/ops/test_ops_accumulate.py tests/ops/test_ops_norm.py tests/ops/test_ops_scale.py tests/ops/test_ops_optim.py
  tests/ops/test_ops_optim_modes.py tests/ops/test_ops_optim_errors.py)
# The CUDA cases that run gradacc's kernels: backend "ext", and in the optimizer files (whose kernel tests take
# ext_device, no backend in their id) every CUDA case but the torch backend's. The errors table's CUDA cases
# raise before any launch, but "nothing is written" is checked on the device.
MEMCHECK_K="cuda and (ext or optim) and not cuda-torch"
STAMP="$(date -u +%Y%m%d-%H%M%S)"
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rs)
: >"$OUT/steps.tsv"

if [[ $DRY -eq 0 ]]; then
  if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_verify.sh: torch sees no CUDA GPU here; on a machine without one, run with --dry-run" >&2
    exit 2
  fi
  CAP="$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")"
else
  CAP="<this GPU's capability>"
fi

# step NAME LIMIT_S CMD...: runs CMD with its output in $OUT/NAME.log, within LIMIT_S and the
# budget left; appends "name status rc seconds limit log" to steps.tsv.
step() {
  local name="$1" limit="$2" rc status start left
  shift 2
  left=$((BUDGET_S - ($(date +%s) - START_S)))
  ((limit > left)) && limit=$left
  if ((limit <= 0)); then
    printf '%s\tskipped (budget)\t-1\t0\t0\t-\n' "$name" >>"$OUT/steps.tsv"
    return
  fi
  start=$(date +%s%N)
  echo "[$name] $* (limit ${limit}s)" | tee "$OUT/$name.log"
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$name.log" 2>&1
  rc=$?
  case $rc in 0) status=ok ;; 124 | 137) status=timeout ;; *) status=failed ;; esac
  printf '%s\t%s\t%d\t%.1f\t%d\t%s\n' "$name" "$status" "$rc" "$(echo "($(date +%s%N) - $start) / 1000000000" | bc -l)" \
    "$limit" "$name.log" >>"$OUT/steps.tsv"
  echo "[$name] $status (rc $rc)"
}

# A planned step that a dry run does not execute: what it would run, and that its files exist.
plan() {
  local name="$1" limit="$2" missing=""
  shift 2
  for f in "$@"; do  # the repository's files the step names (tools are checked on the GPU machine)
    [[ "$f" == */* && "$f" != -* && "$f" != /* && "$f" != *=* && ! -e "$f" ]] && missing+=" $f"
  done
  echo "[$name] would run (limit ${limit}s): $*"
  if [[ -n "$missing" ]]; then
    printf '%s\tfailed (missing:%s)\t1\t0\t%d\t-\n' "$name" "$missing" "$limit" >>"$OUT/steps.tsv"
  else
    printf '%s\tdry-run\t0\t0\t%d\t-\n' "$name" "$limit" >>"$OUT/steps.tsv"
  fi
}

# fused_bench NAME WORKLOAD SCALE: the fused-step benchmark on the GPU, its table and JSON into results/ and DIR.
fused_bench() {
  local res="benchmarks/results/${STAMP}_fused_step_cuda_$2"
  step "$1" 45 "${FSTEP[@]}" "${FSTEP_GPU[@]}" --workload "$2" --scale "$3" --out "$res.md" --json "$res.json"
  cp "$res".* "$OUT/" 2>/dev/null
}

BUILD=(env "TORCH_CUDA_ARCH_LIST=$CAP" "MAX_JOBS=$JOBS" "$PY" setup.py build_ext --inplace)
# test_gpu_checks.py is step 4; test_gpu_verify.py runs this script's --dry-run, not needed inside itself.
TESTS=(env GRADACC_REQUIRE_EXT=1 "${PYTEST[@]}" tests --ignore=tests/gpu/test_gpu_checks.py --ignore=tests/gpu/test_gpu_verify.py
  "--junitxml=$OUT/tests.xml")
CHECKS=(env GRADACC_REQUIRE_EXT=1 "${PYTEST[@]}" tests/gpu/test_gpu_checks.py)
MEMCHECK=("$SANITIZER" --tool memcheck --error-exitcode 9 --target-processes all "${PYTEST[@]}" "${OP_TESTS[@]}" -x
  -k "$MEMCHECK_K")
RACECHECK=("$SANITIZER" --tool racecheck --racecheck-report all --error-exitcode 9 "$PY" scripts/gpu_smoke_ops.py --device cuda)
# The >2^31-element tensor is gpu_checks' job: its benchmark cell alone would take much of the budget.
BENCH=("$PY" benchmarks/compare.py --device cuda --workloads gpt2-small,small-2000 --ops acc_bf16,tail,norm
  --min-time 0.2 --max-time 1.0 --no-plot --out-dir benchmarks/results)
# Issue 10's op-level benchmark. No torch.compile contender: its first call compiled for 53 s (gpt2-small, 148
# tensors) and 118 s (gpt-1.3b) on a 2-core CPU VM; on an H100 host inductor also generates and compiles Triton
# kernels for every fused group: an estimate of 30-90 s cold per workload (not measured: no GPU has run this),
# more than these steps' limits, and the issue's GPU targets compare against torch's fused AdamW, not compile.
# --copy-mib 4096: two 1 GiB roofline streams (~1 ms a call on an H100), so the timer's syncs and Python (tens of
# us) add ~2% to a roofline call, not the ~10% of the default 2 x 256 MiB. gpt-1.3b at half size: four contenders'
# params, buffers, bf16 grads and AdamW states (18 B/param each) take 47 GB of the GPU's 80 at scale 0.5, 95 at 1.
FSTEP=("$PY" benchmarks/fused_step.py --no-compile)
FSTEP_GPU=(--device cuda --repeats 7 --copy-mib 4096)

step env 30 "$PY" scripts/gpu_verify_report.py env "$OUT"
if [[ $DRY -eq 1 ]]; then
  echo "dry run: budget ${BUDGET_S}s; compute-sanitizer: $([[ -x "$SANITIZER" ]] && echo "$SANITIZER" || echo 'not found (needed on the GPU machine)')"
  bash -n "$0" || printf 'syntax\tfailed\t1\t0\t0\t-\n' >>"$OUT/steps.tsv"
  plan build 180 "${BUILD[@]}" setup.py csrc/cuda/kernels.cu csrc/cuda/optim_kernels.cu
  plan tests 200 "${TESTS[@]}"
  plan memcheck 200 "${MEMCHECK[@]}"
  plan racecheck 200 "${RACECHECK[@]}"
  # The CPU-runnable pieces, in parallel like the GPU steps, with any GPU hidden (same on every machine).
  export CUDA_VISIBLE_DEVICES=""
  plan gpu_checks 200 "${CHECKS[@]}"  # collected (and skipped) by the CPU test suite itself
  step smoke_cpu 120 "$PY" scripts/gpu_smoke_ops.py --device cpu --layouts odd,unaligned &
  step bench_cpu 120 "$PY" benchmarks/compare.py --device cpu --workloads small-2000=0.05 --ops norm \
    --impls gradacc,eager --no-compile --min-time 0 --max-time 0.05 --no-plot \
    --out-dir "$OUT/bench" &
  step bench_step_cpu 120 "${FSTEP[@]}" --device cpu --workload gpt2-small --scale 0.005 --repeats 1 \
    --json "$OUT/fused_step_cpu_gpt2-small.json" &
  wait
  plan bench_step 45 "${FSTEP[@]}" "${FSTEP_GPU[@]}" --workload gpt2-small --scale 1
  plan bench_step_1.3b 45 "${FSTEP[@]}" "${FSTEP_GPU[@]}" --workload gpt-1.3b --scale 0.5
  plan bench 170 "${BENCH[@]}"
  # The GPU benchmark's own arguments, parsed as compare.py will parse them (its config wants a GPU).
  step bench_args 60 "$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); import compare, gradacc_ext.benchmarking as b
a = compare.parse_args(sys.argv[1:]); b.parse_workloads(a.workloads); b.parse_operations(a.ops)" "${BENCH[@]:2}"
else
  step build 180 "${BUILD[@]}"
  if grep -q $'^build\tok' "$OUT/steps.tsv"; then
    step tests 200 "${TESTS[@]}" &
    step gpu_checks 200 "${CHECKS[@]}" &
    step memcheck 200 "${MEMCHECK[@]}" &
    step racecheck 200 "${RACECHECK[@]}" &
    wait
    # the short fused-step benchmarks first: compare.py then takes what is left of the budget (up to its limit)
    fused_bench bench_step gpt2-small 1
    fused_bench bench_step_1.3b gpt-1.3b 0.5
    step bench 170 "${BENCH[@]}"
    cp benchmarks/results/"$(ls -t benchmarks/results | grep -v fused_step | grep -m1 '\.json$' | sed 's/\.json$//')".* \
      "$OUT/" 2>/dev/null
  fi
fi
"$PY" scripts/gpu_verify_report.py summary "$OUT"
rc=$?
cat "$OUT/summary.md"
echo "logs and results: $OUT ($(($(date +%s) - START_S)) s)"
exit $rc
