#!/usr/bin/env bash
# NVIDIA's binary tools cuobjdump and nvdisasm, from their PyPI packages, in one place.
#
#   scripts/cuda_tools.sh PYTHON      prints the folder holding `cuobjdump` and `nvdisasm`
#
# Installs nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm into PYTHON's environment when either is
# missing (pip, the environment's own), then prints the one folder both binaries lie in. The toolkit
# installed here has nvcc and ptxas but neither of these (a minimal CUDA 13.0); the packages are
# NVIDIA's own builds of the same tools. CUDA 13.0's own releases of them are not on the package
# index this project reaches; 13.2.86 is the oldest CUDA 13 release there, and a newer cuobjdump or
# nvdisasm reads the cubins of an older nvcc (never the reverse). Users: scripts/kernel_report.py and
# the wheel checks. Exit 1 with a message on stderr when PYTHON is not given or the install fails.
set -euo pipefail
py="${1:?usage: scripts/cuda_tools.sh PYTHON (the interpreter of the environment to install into)}"
VERSION=13.2.86
PACKAGES=("nvidia-cuda-cuobjdump==$VERSION" "nvidia-cuda-nvdisasm==$VERSION")

# The folder of both binaries, as their packages' file lists place them; prints nothing if either is missing.
bin_dir() {
  "$py" - <<'EOF'
import importlib.metadata as md
import os

dirs = set()
for dist, tool in (("nvidia-cuda-cuobjdump", "cuobjdump"), ("nvidia-cuda-nvdisasm", "nvdisasm")):
    try:
        files = md.distribution(dist).files or []
    except md.PackageNotFoundError:
        raise SystemExit(0)
    paths = [str(f.locate()) for f in files if f.name == tool]
    if not paths or not os.access(paths[0], os.X_OK):
        raise SystemExit(0)
    dirs.add(os.path.dirname(paths[0]))
if len(dirs) == 1:
    print(dirs.pop())
EOF
}

dir="$(bin_dir)"
if [[ -z "$dir" ]]; then
  "$py" -m pip install -q "${PACKAGES[@]}" >&2 || { echo "error: pip could not install ${PACKAGES[*]} into $py's environment" >&2; exit 1; }
  dir="$(bin_dir)"
  [[ -n "$dir" ]] || { echo "error: ${PACKAGES[*]} installed, but cuobjdump and nvdisasm are not in one folder" >&2; exit 1; }
fi
echo "$dir"
