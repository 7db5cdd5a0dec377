#!/usr/bin/env bash
# Usage: scripts/torch_matrix.sh --wheel PATH [--wheel PATH ...] [--torch VERSION ...]
#            [--cache DIR] [--report PATH] [--python PY] [-- PYTEST_ARGS...]
#
# Proof that a built gradacc_ext wheel runs with torch versions other than the one it was built
# against (issue 22, point 4; the result goes to docs/install.md "Which torch the wheels run with").
#
#   --wheel PATH     a gradacc_ext wheel to test (repeatable; at least one)
#   --torch VERSION  a torch release from PyPI (repeatable; default: 2.11.0 2.14.1)
#   --cache DIR      where the throwaway venvs live, one per torch version, reused when they already
#                    hold that torch (default: /tmp/gradacc-matrix; each venv is about 5.5 GB)
#   --report PATH    where the Markdown table goes (default: DIR/report.md)
#   --python PY      the interpreter for the venvs (default: python3)
#   -- ARGS          pytest's arguments instead of the default `tests` (the copy; run from its parent
#                    folder), e.g. -- tests/ops -x for a quick run
#
# For each torch version: a venv with `pip install torch==VERSION` (PyPI's default build: a CUDA
# build, which runs on the CPU). For each wheel, in that venv: the wheel (--force-reinstall --no-deps,
# so torch stays), the test and plot extras of pyproject.toml plus tqdm (the set .ci/run's wheel
# stage installs; lion-pytorch with --no-deps: it would pull a torch); then, from a scratch folder so that the source tree cannot shadow the wheel:
# gradacc_ext imported from site-packages with extension_loaded() True, build_info(), `gradacc info`,
# `gradacc selftest --device cpu`, and the test suite from a COPY of tests/ with GRADACC_REQUIRE_EXT=1
# (a fall-back to pure PyTorch is an ImportError, so it cannot pass silently).
# Ends with one Markdown table row per (torch, wheel), printed and written to the report; the logs
# lie under DIR/logs. Exit status 1 when any row did not pass.
#
# Multi-GB installs: a script run by hand and recorded, NOT part of .ci/run. One run per cache
# dir at a time (runs share the venvs).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
wheels=()
torches=()
cache=/tmp/gradacc-matrix
report=""
python=python3
pytest_args=(tests)
while [[ $# -gt 0 ]]; do
    case "$1" in
    --wheel) wheels+=("$(realpath "$2")"); shift 2 ;;
    --torch) torches+=("$2"); shift 2 ;;
    --cache) cache=$2; shift 2 ;;
    --report) report=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    --) shift; pytest_args=("$@"); break ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ ${#wheels[@]} -gt 0 ]] || { echo "at least one --wheel PATH is needed (see --help)" >&2; exit 2; }
[[ ${#torches[@]} -gt 0 ]] || torches=(2.11.0 2.14.1)
for w in "${wheels[@]}"; do [[ -f $w ]] || { echo "no such wheel: $w" >&2; exit 2; }; done
mkdir -p "$cache/logs"
cache=$(realpath "$cache")
report=${report:-$cache/report.md}
pyver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')

# The test and plot extras as pyproject.toml states them (the demo and benchmark-report tests draw
# PNGs with matplotlib); tqdm is a dependency of the package itself, which --no-deps skips;
# lion-pytorch (the FusedLion oracle) depends on torch, so it goes in with --no-deps.
# Read with this machine's python3 (tomllib: 3.11+), not --python, which may be 3.10.
read -r -a test_deps < <(python3 - "$root/pyproject.toml" <<'PY'
import sys, tomllib
extras = tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]
deps = extras["test"] + extras["plot"]
print(" ".join(d for d in deps if not d.startswith("lion-pytorch")) + " tqdm")
PY
)

# The number before the word $1 in pytest's summary line $2 (0 when absent).
count() {
    local n
    n=$(grep -Eo "[0-9]+ $1\b" <<<"$2" | cut -d' ' -f1 || true)
    echo "${n:-0}"
}

# Makes (or reuses) the venv for torch $1 and prints its path.
torch_venv() {
    local version=$1 venv=$cache/torch-$1-py$pyver log=$cache/logs/venv-torch-$1-py$pyver.log
    if [[ -f $venv/.torch-ready ]] && [[ $("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null) == "$version" ]]; then
        echo "reusing $venv" >&2
    else
        echo "creating $venv (torch $version; log: $log)" >&2
        rm -rf "$venv"
        { "$python" -m venv "$venv" &&
            "$venv/bin/python" -m pip install --upgrade pip &&
            "$venv/bin/python" -m pip install "torch==$version"; } >"$log" 2>&1 || { echo "venv for torch $version failed, see $log" >&2; return 1; }
        touch "$venv/.torch-ready"
    fi
    echo "$venv"
}

# Tests wheel $2 in venv $1 (torch $3). Sets `row`; returns 1 when a step failed.
test_wheel() {
    local venv=$1 wheel=$2 version=$3 name log scratch start summary counts how
    name=$(basename "$wheel")
    log=$cache/logs/torch-$version-py$pyver--${name%.whl}.log
    scratch=$(mktemp -d)
    how="py$pyver, CPU, from site-packages, \`gradacc selftest --device cpu\`, suite from a copy of tests/ with GRADACC_REQUIRE_EXT=1"
    [[ ${pytest_args[*]} == tests ]] || how+=" (pytest ${pytest_args[*]})"
    local torch_build="torch $version (venv broken)"
    fail() {
        echo "FAILED: $1 (torch $version, $name); log: $log" >&2
        tail -n 30 "$log" >&2
        row="| $torch_build | $name | $how | **failed: $1** | | | |"
        rm -rf "$scratch"
        return 1
    }
    echo "=== torch $version x $name (log: $log)"
    {
        echo "=== install"
        "$venv/bin/python" -m pip install --force-reinstall --no-deps "$wheel" &&
            "$venv/bin/python" -m pip install "${test_deps[@]}" &&
            "$venv/bin/python" -m pip install --no-deps lion-pytorch
    } >"$log" 2>&1 || { fail "install"; return 1; }
    # From the scratch folder: neither the cwd nor the source tree can shadow the installed wheel.
    cd "$scratch"
    torch_build=$("$venv/bin/python" -c '
import torch
build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
print(f"torch {torch.__version__} ({build}, run on the CPU)")') || { fail "import torch"; return 1; }
    "$venv/bin/python" "$root/scripts/check_installed_wheel.py" --torch "$version" >>"$log" 2>&1 ||
        { fail "load check"; return 1; }
    grep -E '^(gradacc_ext from|built with|CUDA wheel beside)' "$log"
    ! grep -q '^CUDA wheel beside' "$log" ||
        how+="; its CUDA kernels loaded (aoti_torch_get_current_cuda_stream resolves), not run: no GPU"
    { echo "=== gradacc info"; "$venv/bin/gradacc" info; } >>"$log" 2>&1 || { fail "gradacc info"; return 1; }
    { echo "=== gradacc selftest --device cpu"; "$venv/bin/gradacc" selftest --device cpu; } >>"$log" 2>&1 ||
        { fail "selftest"; return 1; }
    cp -r "$root/tests" "$scratch/tests"
    find "$scratch/tests" -name __pycache__ -prune -exec rm -rf {} +
    echo "=== pytest" >>"$log"
    start=$SECONDS
    local rc=0
    GRADACC_REQUIRE_EXT=1 timeout 1800 "$venv/bin/python" -m pytest -q -ra -p no:cacheprovider \
        --rootdir "$scratch" "${pytest_args[@]}" >>"$log" 2>&1 || rc=$?
    local secs=$((SECONDS - start))
    summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|errors?|deselected)' "$log" | tail -n 1 | sed 's/^=* *//; s/ *=*$//')
    echo "pytest rc=$rc: ${summary:-no summary line}"
    local passed skipped failed errors
    passed=$(count passed "$summary") skipped=$(count skipped "$summary")
    failed=$(count failed "$summary") errors=$(count 'errors?' "$summary")
    [[ $errors == 0 ]] || failed+=" + $errors errors"
    [[ -n $summary ]] || failed="no pytest summary (rc $rc)"
    row="| $torch_build | $name | $how | $passed | $skipped | $failed | $((secs / 60)) min $((secs % 60)) s |"
    rm -rf "$scratch"
    cd "$root"
    [[ $rc -eq 0 ]] || { echo "FAILED: pytest rc=$rc (timeout is 124); log: $log" >&2; return 1; }
}

rows=()
status=0
for version in "${torches[@]}"; do
    if ! venv=$(torch_venv "$version"); then
        for w in "${wheels[@]}"; do rows+=("| torch $version | $(basename "$w") | | **failed: venv** | | | |"); done
        status=1
        continue
    fi
    for w in "${wheels[@]}"; do
        row=""
        test_wheel "$venv" "$w" "$version" || status=1
        cd "$root"
        rows+=("$row")
    done
done

{
    echo "Run $(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -m), $(nproc) CPUs, no GPU use; load: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo
    echo "| torch | wheel | how tested | passed | skipped | failed | suite wall time |"
    echo "|---|---|---|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
} >"$report"
echo
cat "$report"
echo "(written to $report)"
exit "$status"
