#!/usr/bin/env bash
# One-call verification on a GPU machine (docs/gpu.md, "Verifying on a GPU"):
#
#   PYTHON=python3 bash scripts/gpu_verify.sh --out DIR     # give the call 600 s; the run ends within 480
#   bash scripts/gpu_verify.sh --dry-run --out DIR          # anywhere: the rehearsal (CI runs it)
#   ... --wheel PATH                                        # verify a wheel (scripts/build_wheels.sh's) instead
#                                                           # of building from source (docs/gpu.md)
#   ... --wheel CU130.whl --wheel CU124.whl                 # both CUDA wheels in one call: one run each, the
#                                                           # budget split evenly, in DIR/cu130 and DIR/cu124
#
# Steps, most valuable first, one after the other, each with a time limit, stopped by SIGINT (pytest
# then still writes its junit and failure list) and skipped once the budget is spent:
#   preflight        GPU, driver, free memory, nvcc, CUDA_HOME, ninja, Python headers, sanitizer -> preflight.json
#   build            the CUDA build, forced (GRADACC_FORCE_CUDA=1), for this GPU's arch only, CUDA_HOME from nvcc;
#                    with --wheel: `pip install --no-deps --target` of the wheel, run from a copy of tests/,
#                    benchmarks/ and scripts/ so that the source tree cannot shadow it (a real step in a dry run too)
#   kernels          the build holds CUDA kernels for this GPU's arch, else every later step is not run
#   smoke            `gradacc selftest --device cuda`: every kernel against the reference, no sanitizer
#   cuda_tests       the suite's CUDA cases (-k cuda) with pytest-xdist and a per-test timeout; all skipped = failed
#   gpu_checks       a window in a CUDA graph, under sync-debug "error" (GPU_CHECKS)
#   gpu_large        the >2^31-element checks, alone; a skip (not enough GPU memory) = failed
#   sanitizer_probe  compute-sanitizer on a trivial kernel: "unsupported" is recorded apart from findings
#   memcheck         the selftest under memcheck (caching allocator off), our kernels only
#   racecheck        the selftest under racecheck, our kernels only
#   bench_step*      benchmarks/fused_step.py --device cuda (issue 10's targets), gpt2-small, gpt-1.3b at half size
#   bench_eager      benchmarks/compare.py against torch eager; bench_compile against torch.compile, last
#                    (cold compiles take minutes: dropped when under a minute of the budget is left)
# Output (--out DIR, default $OUT when set, else gpu_verify_out/<date>): summary.md, summary.json and
# gpu_verify_logs.tar.gz (every log, junit file and result), nothing else. stdout ends with the tail of every
# step that did not pass, then the summary table, last. Exit status 0 only if every step passed.
#
# --dry-run rehearses the same runner, packaging and summary without a GPU: the selftest on the CPU, a
# pytest subset (REHEARSAL_TESTS, its cpu cases) writing junit, the GPU checks' selections collected, tiny
# CPU benchmarks; only the build and the sanitizers are simulated (their commands printed, their files checked).
#
# Environment: PYTHON (default python3, then python), NVCC, CUDA_HOME (default: nvcc's own TOP),
# COMPUTE_SANITIZER, GPU_VERIFY_BUDGET_S (480), GPU_VERIFY_LIMITS ("step=seconds ..." to override a step's
# limit), GPU_VERIFY_REHEARSAL_TESTS (paths replacing REHEARSAL_TESTS).
set -uo pipefail

# ---- The test paths this script names, in one place (update here when tests move). ----
SUITE=tests                                      # cuda_tests: every CUDA case of the suite (-k cuda)
GPU_CHECKS=tests/gpu/test_gpu_checks.py          # run by path (gpu_checks, gpu_large); tests/conftest.py's exemption
LARGE_K="beyond_2_31"                            # gpu_large's -k: the >2^31-element checks
REHEARSAL_TESTS=(tests/ops/test_ops_scale.py)    # --dry-run's stand-in for cuda_tests (-k cpu)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
DRY=0
WHEELS=()
OUT_DIR="${OUT:-}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUT_DIR="${2:?--out needs a folder}"; shift ;;
    --wheel) WHEELS+=("$(realpath "${2:?--wheel needs a .whl path}")"); shift
      [[ -f "${WHEELS[-1]}" && "${WHEELS[-1]}" == *.whl ]] ||
        { echo "gpu_verify.sh: --wheel ${WHEELS[-1]} is not a .whl file" >&2; exit 2; } ;;
    -h | --help) sed -n '2,38p' "$0"; exit 0 ;;
    *) echo "gpu_verify.sh: unknown argument '$1' (expected --out DIR, --dry-run, --wheel PATH)" >&2; exit 2 ;;
  esac
  shift
done
if [[ ${#WHEELS[@]} -gt 1 ]]; then  # one run per wheel, each into OUT/<its local version>, sharing the budget
  OUT_DIR="${OUT_DIR:-gpu_verify_out/$(date -u +%Y%m%d-%H%M%S)}"
  status=0
  for wheel in "${WHEELS[@]}"; do
    label="$(sed -n 's/^gradacc_ext-[^-+]*+\(cu[0-9]*\)-.*/\1/p' <<<"${wheel##*/}")"
    GPU_VERIFY_BUDGET_S=$((${GPU_VERIFY_BUDGET_S:-480} / ${#WHEELS[@]})) bash "$0" $([[ $DRY -eq 1 ]] && echo --dry-run) \
      --wheel "$wheel" --out "$OUT_DIR/${label:-cpu}" || status=1
  done
  exit "$status"
fi
WHEEL="${WHEELS[0]:-}"
[[ -n "${GPU_VERIFY_REHEARSAL_TESTS:-}" ]] && read -ra REHEARSAL_TESTS <<<"$GPU_VERIFY_REHEARSAL_TESTS"
OUT_DIR="${OUT_DIR:-gpu_verify_out/$(date -u +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT_DIR" && OUT_DIR="$(cd "$OUT_DIR" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_verify.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/logs" "$WORK/junit" "$WORK/results"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
if [[ -z "$WHEEL" ]]; then
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the in-place build, for the scripts and the tests
else
  # The wheel's files in $SITE; every step runs in a copy of the tree with no gradacc_ext/ to shadow them
  # (both outside $WORK, which the report archives whole).
  WHEEL_WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_verify_wheel.XXXXXX")"
  trap 'rm -rf "$WORK" "$WHEEL_WORK"' EXIT
  SITE="$WHEEL_WORK/site"
  mkdir -p "$SITE" "$WHEEL_WORK/tree"
  cp -r tests benchmarks scripts pyproject.toml "$WHEEL_WORK/tree/"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" GPU_VERIFY_SOURCE="$ROOT" GPU_VERIFY_WHEEL="${WHEEL##*/}"
  cd "$WHEEL_WORK/tree" || exit 2
fi
BUDGET_S="${GPU_VERIFY_BUDGET_S:-480}"
RESERVE_S=20    # the summary and the archive, after the last step
KILL_AFTER_S=5  # a step that ignores SIGINT is killed this much later
START_S=$(date +%s)
JOBS="$(nproc)"
export NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
export CUDA_HOME="${CUDA_HOME:-$(bash scripts/cuda_home.sh "$NVCC" 2>/dev/null)}"
export SANITIZER="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")}"
CHECK=("$PY" scripts/gpu_verify_checks.py)
: >"$WORK/steps.tsv"

if [[ $DRY -eq 0 ]]; then
  if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_verify.sh: torch ($("$PY" -c 'import torch; print(torch.__version__)' 2>&1 | tail -n1)) under $PY sees" \
      "no CUDA GPU; set PYTHON to the interpreter with a CUDA torch, or on a machine without a GPU run --dry-run" >&2
    exit 2
  fi
  CAP="$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")"
  DEVICE=cuda
else
  export CUDA_VISIBLE_DEVICES=""  # the rehearsal is the same on every machine
  CAP="<this GPU's capability>"
  DEVICE=cpu
fi

# pytest with the plugins the GPU machine has (recorded by the preflight; CI may lack them)
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rs)
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n "$((JOBS / 2 > 8 ? 8 : (JOBS / 2 > 1 ? JOBS / 2 : 1)))") || XDIST=()
"$PY" -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout) || PER_TEST=()

record() {  # record NAME STATUS RC MS LIMIT NOTE: one line of steps.tsv
  printf '%s\t%s\t%d\t%d.%d\t%d\t%s\n' "$1" "$2" "$3" "$(($4 / 1000))" "$(($4 % 1000 / 100))" "$5" "${6//$'\t'/ }" \
    >>"$WORK/steps.tsv"
}

limit_of() {  # limit_of NAME DEFAULT: GPU_VERIFY_LIMITS's "NAME=S" if given
  local kv limits="${GPU_VERIFY_LIMITS:-}"
  for kv in ${limits//,/ }; do [[ "${kv%%=*}" == "$1" ]] && { echo "${kv#*=}"; return; }; done
  echo "$2"
}

# step NAME LIMIT CMD...: runs CMD, its output in logs/NAME.log, within LIMIT and what is left of the budget
# (MIN_S, default 10 s, at least, else skipped), stopped by SIGINT at the limit. POST (an array), when set,
# then judges a finished run (the junit checks). rc 9 of a sanitizer is "findings". Returns 0 if ok.
POST=()
step() {
  local name="$1" limit left rc status note="" start ms log="$WORK/logs/$1.log"
  limit="$(limit_of "$1" "$2")"
  shift 2
  left=$((BUDGET_S - RESERVE_S - KILL_AFTER_S - ($(date +%s) - START_S)))
  ((limit > left)) && limit=$left
  if ((limit < ${MIN_S:-10})); then
    local why="${left}s of the budget left"
    ((limit < left)) && why="its limit is ${limit}s (GPU_VERIFY_LIMITS)"
    record "$name" "skipped (budget)" -1 0 0 "$why"
    echo "[$name] skipped: $why"
    POST=()
    return 1
  fi
  echo "[$name] $* (limit ${limit}s)" >"$log"
  start=$(date +%s%N)
  timeout -s INT -k "$KILL_AFTER_S" "$limit" "$@" >>"$log" 2>&1 </dev/null
  rc=$?
  ms=$((($(date +%s%N) - start) / 1000000))
  case "$rc" in
    0) status=ok ;;
    124 | 137) status=timeout note="stopped by SIGINT at ${limit}s" ;;
    9) [[ "$name" == *check ]] && status=findings || status=failed ;;
    *) status=failed ;;
  esac
  if [[ $status == ok && ${#POST[@]} -gt 0 ]] && ! "${POST[@]}" >>"$log" 2>&1; then
    status=failed note="$(tail -n1 "$log")"
  fi
  POST=()
  record "$name" "$status" "$rc" "$ms" "$limit" "$note"
  echo "[$name] $status (rc $rc, $((ms / 1000)) s of ${limit})"
  [[ $status == ok ]]
}

# simulate NAME LIMIT CMD...: a dry run's stand-in for a step that needs a GPU: the command and the repository
# files it names (and those in NEEDS) checked.
simulate() {
  local name="$1" limit="$2" missing="" f
  shift 2
  for f in "$@" ${NEEDS:-}; do
    [[ "$f" == */* && "$f" != -* && "$f" != /* && "$f" != *=* && ! -e "$f" ]] && missing+=" $f"
  done
  echo "would run (limit ${limit}s): $*" >"$WORK/logs/$name.log"
  if [[ -n "$missing" ]]; then
    record "$name" failed 1 0 "$limit" "missing:$missing"
  else
    record "$name" simulated 0 0 "$limit" "needs a GPU; the command is in its log"
  fi
  echo "[$name] simulated: $*"
}

not_run() {  # not_run REASON NAME...: steps that cannot run after an earlier failure
  local reason="$1" name
  shift
  for name in "$@"; do record "$name" "not run" -1 0 0 "$reason"; done
}

junit() { echo "--junitxml=$WORK/junit/$1.xml"; }
# Skip reasons that on the GPU machine mean the GPU or the CUDA kernels were not seen (tests/conftest.py's)
NO_GPU_SKIPS="CUDA is not available|requested for cuda"
# POST for a pytest step NAME: some KEYWORD test passed (none skipped with --no-skips)
post_junit() { POST=("${CHECK[@]}" junit "$WORK/junit/$1.xml" --keyword "$2" "${@:3}"); }

BUILD=(env GRADACC_FORCE_CUDA=1 GRADACC_CPU_VARIANTS=0 "TORCH_CUDA_ARCH_LIST=$CAP" "MAX_JOBS=$JOBS"
  "$PY" setup.py build_ext --inplace)
[[ -n "$WHEEL" ]] && BUILD=("$PY" -m pip install --no-deps --no-index --target "$SITE" "$WHEEL")
SELFTEST=("$PY" -m gradacc_ext selftest --device "$DEVICE")
SAN_ONLY_OURS=(--kernel-name kns=gradacc --error-exitcode 9)
PROBE=("$SANITIZER" --tool memcheck "$PY" -c "import torch; x = torch.ones(8, device='cuda'); x.add_(1); print(x.sum().item())")
MEMCHECK=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" --tool memcheck "${SAN_ONLY_OURS[@]}" "${SELFTEST[@]}")
RACECHECK=("$SANITIZER" --tool racecheck --racecheck-report all "${SAN_ONLY_OURS[@]}" "${SELFTEST[@]}"
  --layouts odd,unaligned)
# --copy-mib 4096: two 1 GiB roofline streams, so the timer's syncs add ~2% to a roofline call. gpt-1.3b at half
# size: four contenders' params, buffers, bf16 grads and AdamW states (18 B/param each) take 47 GB at scale 0.5.
FSTEP=("$PY" benchmarks/fused_step.py --no-compile)
FSTEP_GPU=(--device cuda --repeats 7 --copy-mib 4096)
BENCH=("$PY" benchmarks/compare.py --device cuda --workloads gpt2-small,small-2000 --ops acc_bf16,tail,norm
  --min-time 0.2 --max-time 1.0 --no-plot)

fused_bench() {  # fused_bench NAME WORKLOAD SCALE
  local res="$WORK/results/fused_step_cuda_$2"
  step "$1" 40 "${FSTEP[@]}" "${FSTEP_GPU[@]}" --workload "$2" --scale "$3" --out "$res.md" --json "$res.json"
}

echo "gpu_verify: $([[ $DRY -eq 1 ]] && echo rehearsal || echo "compute $CAP"), budget ${BUDGET_S}s, python $PY," \
  "out $OUT_DIR${WHEEL:+, wheel $WHEEL}"
step preflight 30 "${CHECK[@]}" preflight "$WORK" $([[ $DRY -eq 1 ]] && echo --dry-run)
PREFLIGHT=$?
if [[ $DRY -eq 1 ]]; then
  if [[ -n "$WHEEL" ]]; then
    step build 60 "${BUILD[@]}"
  else
    NEEDS="csrc/cuda/kernels.cu csrc/cuda/optim_kernels.cu scripts/cuda_home.sh" simulate build 170 "${BUILD[@]}"
  fi
  step kernels 20 "${CHECK[@]}" kernels --device cpu
  step smoke 40 "${SELFTEST[@]}" --layouts odd,unaligned
  post_junit cuda_tests cpu
  step cuda_tests 120 "${PYTEST[@]}" "${XDIST[@]}" "${PER_TEST[@]/%/=60}" "${REHEARSAL_TESTS[@]}" -k cpu \
    "$(junit cuda_tests)"
  # the GPU checks' selections, collected (their tests skip without CUDA)
  step gpu_checks 60 "${PYTEST[@]}" --collect-only "$GPU_CHECKS" -k "not $LARGE_K"
  step gpu_large 60 "${PYTEST[@]}" --collect-only "$GPU_CHECKS" -k "$LARGE_K"
  simulate sanitizer_probe 30 "${PROBE[@]}"
  simulate memcheck 60 "${MEMCHECK[@]}"
  simulate racecheck 60 "${RACECHECK[@]}"
  step bench_step 40 "${FSTEP[@]}" --device cpu --workload gpt2-small --scale 0.005 --repeats 1 \
    --json "$WORK/results/fused_step_cpu_gpt2-small.json"
  step bench_eager 60 "$PY" benchmarks/compare.py --device cpu --workloads small-2000=0.05 --ops norm \
    --impls gradacc,eager --no-compile --min-time 0 --max-time 0.05 --no-plot --out-dir "$WORK/results/compare_eager"
  # the GPU benchmark's arguments, parsed as compare.py parses them (its config wants a GPU)
  step bench_compile 60 "$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); import compare, gradacc_ext.benchmarking as b
a = compare.parse_args(sys.argv[1:]); b.parse_workloads(a.workloads); b.parse_operations(a.ops)" "${BENCH[@]:2}" \
    --impls gradacc,compile
elif [[ $PREFLIGHT -ne 0 ]]; then
  not_run "preflight failed" build kernels smoke cuda_tests gpu_checks gpu_large sanitizer_probe memcheck racecheck \
    bench_step bench_step_1.3b bench_eager bench_compile
elif ! { step build 170 "${BUILD[@]}" && step kernels 20 "${CHECK[@]}" kernels --device cuda; }; then
  grep -q $'^kernels\t' "$WORK/steps.tsv" || not_run "build failed" kernels
  not_run "no CUDA kernels" smoke cuda_tests gpu_checks gpu_large sanitizer_probe memcheck racecheck bench_step \
    bench_step_1.3b bench_eager bench_compile
else
  export GRADACC_REQUIRE_EXT=1
  step smoke 40 "${SELFTEST[@]}"
  post_junit cuda_tests cuda --bad-skips "$NO_GPU_SKIPS"
  step cuda_tests 130 "${PYTEST[@]}" "${XDIST[@]}" "${PER_TEST[@]/%/=60}" "$SUITE" --ignore="$GPU_CHECKS" -k cuda \
    "$(junit cuda_tests)"
  post_junit gpu_checks "" --bad-skips "$NO_GPU_SKIPS"
  step gpu_checks 60 "${PYTEST[@]}" "${PER_TEST[@]/%/=60}" "$GPU_CHECKS" -k "not $LARGE_K" "$(junit gpu_checks)"
  post_junit gpu_large "" --no-skips
  step gpu_large 60 "${PYTEST[@]}" "${PER_TEST[@]/%/=120}" "$GPU_CHECKS" -k "$LARGE_K" "$(junit gpu_large)"
  if step sanitizer_probe 30 "${PROBE[@]}"; then
    step memcheck 60 "${MEMCHECK[@]}"
    step racecheck 60 "${RACECHECK[@]}"
  else
    "${CHECK[@]}" sanitizer "$WORK/logs/sanitizer_probe.log" 1 >>"$WORK/logs/sanitizer_probe.log"
    [[ $? -eq 3 ]] && sed -i $'s/^sanitizer_probe\tfailed\t/sanitizer_probe\tunsupported\t/' "$WORK/steps.tsv"
    not_run "the sanitizer probe did not pass" memcheck racecheck
  fi
  fused_bench bench_step gpt2-small 1
  fused_bench bench_step_1.3b gpt-1.3b 0.5
  step bench_eager 90 "${BENCH[@]}" --impls gradacc,eager --no-compile --out-dir "$WORK/results/compare_eager"
  MIN_S=60 step bench_compile 150 "${BENCH[@]}" --impls gradacc,compile --out-dir "$WORK/results/compare_compile"
fi
echo "gpu_verify: steps done in $(($(date +%s) - START_S)) s; the summary follows"
"$PY" scripts/gpu_verify_report.py "$WORK" "$OUT_DIR" $([[ $DRY -eq 1 ]] && echo --dry-run)
rc=$?
if ((rc > 1)); then  # the report itself failed: still bring back every log, and the steps last
  tar -czf "$OUT_DIR/gpu_verify_logs.tar.gz" -C "$WORK" .
  echo "gpu_verify_report.py failed (rc $rc); the steps (name, status, rc, seconds, limit, note):"
  cat "$WORK/steps.tsv"
fi
exit "$rc"
