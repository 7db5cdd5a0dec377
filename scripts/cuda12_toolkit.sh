#!/usr/bin/env bash
# Assembles a CUDA 12.4 toolkit (nvcc, headers, static runtime) in a folder, from packages, and prints its root.
#
#   scripts/cuda12_toolkit.sh [DIR]      (default /tmp/gradacc-cuda12; reused when already assembled)
#
# For the CUDA 12 wheel (scripts/build_wheels.sh --variant cuda12), on a machine whose own toolkit is CUDA 13.
# No one package source has a whole CUDA 12 toolkit here:
#   - NVIDIA's PyPI packages for 12.x (nvidia-cuda-nvcc-cu12) hold ptxas, libnvvm, libdevice and the crt headers,
#     but no nvcc, cicc, cudafe++ or fatbinary (they serve JIT compilation); nvidia-cuda-runtime-cu12 holds the
#     runtime headers, and libcudart_static.a only from 12.9 on.
#   - Debian's nvidia-cuda-toolkit (trixie, non-free) is NVIDIA's 12.4 compiler driver and its tools; Debian's
#     newest CUDA 12. Its headers and static runtime are in nvidia-cuda-dev, a 934 MB download.
# So: the compiler from Debian's nvidia-cuda-toolkit 12.4.131 (unpacked with dpkg -x, not installed), the 12.4
# headers and libdevice from PyPI's 12.4 packages, and libcudart_static.a from nvidia-cuda-runtime-cu12 12.9.79.
# (No libcudadevrt: nvlink refuses 12.9's with a 12.4 toolkit; _C uses no relocatable device code.)
# A newer 12.x runtime serves code compiled by an older 12.x nvcc (CUDA's minor-version compatibility; the
# fat-binary registration API is the same), and a statically linked 12.x runtime runs on any driver for
# CUDA 12.0 or newer (r525.60.13+). apt-get reads Debian's package list through a private configuration in
# DIR (the machine's own apt sources stay as they are). About 110 MB of downloads, 400 MB unpacked.
set -euo pipefail
dir="$(realpath -m "${1:-/tmp/gradacc-cuda12}")"
cuda="$dir/cuda-12.4"
DEB_VERSION="12.4.131~12.4.1-2"
PYPI=("nvidia-cuda-nvcc-cu12==12.4.131" "nvidia-cuda-runtime-cu12==12.4.127")
STATIC_RUNTIME="nvidia-cuda-runtime-cu12==12.9.79"
PYTHON="${PYTHON:-python3}"

if [[ -f $cuda/.assembled ]]; then  # written last, after the smoke test below passed
  echo "$cuda"
  exit 0
fi
log="$dir/assemble.log"
mkdir -p "$dir/apt/lists/partial" "$dir/apt/cache/archives/partial" "$dir/debs" "$dir/wheels" "$dir/static"
: >"$log"
fail() { tail -n 20 "$log" >&2; echo "error: $1 (log: $log)" >&2; exit 1; }

# Debian's compiler driver and tools: a private apt configuration for trixie's non-free section.
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie non-free" \
  >"$dir/apt/sources.list"
touch "$dir/apt/status"
apt_opts=(-o "Dir::Etc::SourceList=$dir/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::State::Lists=$dir/apt/lists" -o "Dir::Cache=$dir/apt/cache" -o "Dir::State::status=$dir/apt/status" -o APT::Sandbox::User=root)
apt-get "${apt_opts[@]}" update >>"$log" 2>&1 || fail "apt-get update (Debian trixie non-free) failed"
(cd "$dir/debs" && apt-get "${apt_opts[@]}" download "nvidia-cuda-toolkit=$DEB_VERSION") >>"$log" 2>&1 ||
  fail "apt-get download nvidia-cuda-toolkit=$DEB_VERSION failed"
rm -rf "$dir/deb" && dpkg -x "$dir"/debs/nvidia-cuda-toolkit_*.deb "$dir/deb"

# NVIDIA's PyPI packages: the 12.4 headers and libdevice; the static runtime of 12.9.
"$PYTHON" -m pip download -q --no-deps -d "$dir/wheels" "${PYPI[@]}" >>"$log" 2>&1 || fail "pip download ${PYPI[*]} failed"
"$PYTHON" -m pip download -q --no-deps -d "$dir/static" "$STATIC_RUNTIME" >>"$log" 2>&1 || fail "pip download $STATIC_RUNTIME failed"
rm -rf "$dir/pypi" && mkdir -p "$dir/pypi"
for wheel in "$dir"/wheels/*.whl; do "$PYTHON" -m zipfile -e "$wheel" "$dir/pypi"; done
"$PYTHON" -m zipfile -e "$dir"/static/*.whl "$dir/static/unpacked"

# The layout nvcc expects: bin/ (with its nvcc.profile), nvvm/, include/, lib64/.
rm -rf "$cuda" && mkdir -p "$cuda/bin" "$cuda/nvvm/bin" "$cuda/include" "$cuda/lib64"
tools="$dir/deb/usr/lib/nvidia-cuda-toolkit/bin"
cp "$tools/nvcc" "$cuda/bin/" && cp -r "$tools/crt" "$cuda/bin/" && cp "$tools/cicc" "$cuda/nvvm/bin/"
for tool in cudafe++ fatbinary nvlink ptxas bin2c nvprune cuobjdump; do cp "$dir/deb/usr/bin/$tool" "$cuda/bin/"; done
cp -r "$dir"/pypi/nvidia/cuda_runtime/include/. "$dir"/pypi/nvidia/cuda_nvcc/include/. "$cuda/include/"
cp -r "$dir/pypi/nvidia/cuda_nvcc/nvvm/libdevice" "$cuda/nvvm/"
cp "$dir/static/unpacked/nvidia/cuda_runtime/lib/libcudart_static.a" "$cuda/lib64/"
find "$cuda" -name __init__.py -delete
chmod +x "$cuda"/bin/* "$cuda/nvvm/bin/cicc"
cat >"$cuda/bin/nvcc.profile" <<'EOF'
TOP              = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
PATH            += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES        +=  "-I$(TOP)/include" $(_SPACE_)
LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/lib64"
EOF
"$cuda/bin/nvcc" --version | grep -q "release 12.4" || fail "the assembled nvcc does not report release 12.4"
# A smoke test of the assembly, as setup.py builds _C: nvcc compiles a kernel, the host linker adds the runtime.
printf '__global__ void k(float* x) { x[0] = 1.0f; }\nextern "C" int launch() { k<<<1, 1>>>(nullptr); return 0; }\n' \
  >"$dir/smoke.cu"
{ "$cuda/bin/nvcc" -arch=sm_80 -Xcompiler -fPIC -c "$dir/smoke.cu" -o "$dir/smoke.o" &&
  c++ -shared "$dir/smoke.o" -L"$cuda/lib64" -lcudart_static -ldl -lrt -lpthread -o "$dir/smoke.so"; } >>"$log" 2>&1 ||
  fail "the assembled toolkit cannot build a kernel into a shared object"
touch "$cuda/.assembled"
echo "$cuda"
