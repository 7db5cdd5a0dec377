"""Prints a fingerprint of everything the compiled extension depends on (stdlib only, no torch import).

./scripts/quickstart.sh stores it in the virtual environment after a successful
install and skips the install (and its two-minute rebuild) while it is unchanged:
the C++/CUDA sources and build files, the torch and Python versions, the build
switches, nvcc, and the built library itself (deleting it forces a rebuild).
Python sources need no rebuild: the install is editable.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("csrc", "setup.py", "pyproject.toml")
SWITCHES = ("GRADACC_NO_EXT", "GRADACC_NO_CUDA", "GRADACC_FORCE_CUDA", "TORCH_CUDA_ARCH_LIST", "CUDA_HOME")


def fingerprint(root: Path = ROOT) -> str:
    digest = hashlib.sha256()

    def add(label: str, value: str | bytes) -> None:
        digest.update(label.encode() + b"\0" + (value if isinstance(value, bytes) else value.encode()) + b"\0")

    for name in SOURCES:
        path = root / name
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            add(str(f.relative_to(root)), f.read_bytes() if f.exists() else b"<missing>")
    try:
        add("torch", importlib.metadata.version("torch"))
    except importlib.metadata.PackageNotFoundError:
        add("torch", "<not installed>")
    add("python", sys.version)
    for name in SWITCHES:
        add(name, os.environ.get(name, "<unset>"))
    add("nvcc", shutil.which("nvcc") or "<none>")
    for lib in sorted((root / "gradacc_ext").glob("_C*.so")):
        stat = lib.stat()
        add(lib.name, f"{stat.st_size}:{stat.st_mtime_ns}")
    return digest.hexdigest()


if __name__ == "__main__":
    print(fingerprint())
