"""The checks scripts/gpu_verify.sh runs between its steps.

    python scripts/gpu_verify_checks.py preflight WORK [--dry-run]   # WORK/preflight.json; 1 if a tool is missing
    python scripts/gpu_verify_checks.py kernels --device cuda|cpu     # the build holds kernels for this device
    python scripts/gpu_verify_checks.py junit FILE --keyword K [--no-skips] [--bad-skips REGEX]
    python scripts/gpu_verify_checks.py sanitizer LOG RC              # a probe's outcome: supported, unsupported

junit: a pytest step passes only if some test whose id holds K ran and passed (all of them skipped
is a failure: a CPU-only build, no GPU seen); with --no-skips any skip of such a test fails it
(the >2^31-element checks skip when the GPU lacks the memory); with --bad-skips a skip whose reason
matches REGEX fails it (on the GPU machine no test may skip for want of CUDA or of the CUDA kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What compute-sanitizer prints when it cannot run on this device or driver, as opposed to a finding.
UNSUPPORTED = re.compile(r"not supported|unsupported|Unable to find|insufficient", re.I)
NVCC_RELEASE, SANITIZER_VERSION = r"release [0-9.]+", r"[0-9]{4}\.[0-9.]+"


def _run(*cmd: str) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=ROOT)
        return (proc.stdout + proc.stderr).strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _first(text: str, pattern: str) -> str | None:
    match = re.search(pattern, text)
    return match[0] if match else None


def preflight(work: Path, dry_run: bool) -> int:
    """Records the machine and its tools in WORK/preflight.json; 1 when the real run cannot build."""
    import torch

    gpus = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        major, minor = torch.cuda.get_device_capability(i)
        gpus.append({"name": torch.cuda.get_device_name(i), "capability": f"{major}.{minor}",
                     "free_gib": round(free / 2**30, 1), "total_gib": round(total / 2**30, 1)})  # fmt: skip
    nvcc, ninja, sanitizer = os.environ.get("NVCC"), shutil.which("ninja"), os.environ.get("SANITIZER")
    include = Path(sysconfig.get_paths()["include"])
    # With --wheel the steps run in a copy of the tree; the commit is the source tree's (GPU_VERIFY_SOURCE).
    source = os.environ.get("GPU_VERIFY_SOURCE", str(ROOT))
    commit = _run("git", "-C", source, "rev-parse", "HEAD")
    dirty = bool(_run("git", "-C", source, "status", "--porcelain", "--untracked-files=no"))
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit + ("-dirty" if dirty else "") if commit else "unknown",
        "wheel": os.environ.get("GPU_VERIFY_WHEEL") or None,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "python": f"{sys.executable} {platform.python_version()}",
        "python_headers": str(include) if (include / "Python.h").exists() else None,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "driver": (_run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader").splitlines() or [None])[0]
        if shutil.which("nvidia-smi") else None,
        "gpus": gpus,
        "nvcc": f"{nvcc} ({_first(_run(nvcc, '--version'), NVCC_RELEASE)})" if nvcc else None,
        "cuda_home": os.environ.get("CUDA_HOME") or None,
        "ninja": f"{ninja} ({_run(ninja, '--version')})" if ninja else None,
        "compute_sanitizer": f"{sanitizer} ({_first(_run(sanitizer, '--version'), SANITIZER_VERSION)})"
        if sanitizer and os.access(sanitizer, os.X_OK) else None,
        "pytest_plugins": {name: _has(module) for name, module in (("xdist", "xdist"), ("timeout", "pytest_timeout"))},
    }  # fmt: skip
    (work / "preflight.json").write_text(json.dumps(record, indent=2) + "\n")
    needed = {"a CUDA GPU seen by torch": gpus, "nvcc": nvcc, "CUDA_HOME (nvcc's TOP)": record["cuda_home"],
              "ninja on PATH": ninja, "Python headers (Python.h)": record["python_headers"]}  # fmt: skip
    missing = [what for what, have in needed.items() if not have]
    print(json.dumps(record, indent=2))
    if missing and not dry_run:
        print(f"preflight: cannot build and test on this machine: missing {', '.join(missing)}")
        return 1
    if missing:
        print(f"preflight (dry run, recorded only): missing {', '.join(missing)}")
    return 0


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def kernels(device: str) -> int:
    """The in-place build holds compiled kernels for `device`: for cuda, CUDA kernels registered with the
    dispatcher and covering this GPU's arch (and, where cuobjdump exists, a cubin or PTX for it in _C)."""
    import torch

    import gradacc_ext
    from gradacc_ext.ops import coverage as gpu_coverage

    info = gradacc_ext.build_info()
    print(json.dumps(info, indent=2))
    if not info["extension_loaded"]:
        print(f"kernels: the compiled extension is not loaded: {info['reason']}")
        return 1
    if device == "cpu":
        print(f"kernels: C++ CPU kernels loaded ({info['cpu_isa']} of {info['cpu_isas']})")
        return 0
    registered = torch._C._dispatch_has_kernel_for_dispatch_key("gradacc::accumulate_", "CUDA")
    if not info["with_cuda"] or not registered:
        print("kernels: the build holds no CUDA kernels (a CPU-only build: was nvcc or CUDA_HOME missing?)")
        return 1
    coverage = gpu_coverage.device_coverage(0)
    print(f"kernels: {coverage.device} ({coverage.name}): {coverage.reason}")
    if not coverage.covered:
        return 1
    cuobjdump = shutil.which("cuobjdump") or str(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin/cuobjdump")
    if os.access(cuobjdump, os.X_OK):
        arch = "sm_{}{}".format(*torch.cuda.get_device_capability(0))
        built = next(Path(gradacc_ext.__file__).parent.glob("_C*.so"))  # the wheel's, with --wheel
        listing = _run(cuobjdump, "--list-elf", "--list-ptx", str(built))
        print(listing)
        if arch not in listing and "compute_" not in listing:
            print(f"kernels: cuobjdump finds no {arch} code in _C")
            return 1
    return 0


def junit(file: Path, keyword: str, no_skips: bool, bad_skips: str | None = None) -> int:
    """Whether the pytest step whose junit is `file` tested something: see the module's docstring."""
    if not file.exists():
        print(f"junit: {file.name} was not written")
        return 1
    cases = [c for c in ET.parse(file).iter("testcase") if keyword in f"{c.get('classname')}.{c.get('name')}"]
    skipped = [c for c in cases if c.find("skipped") is not None]
    bad = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
    passed = len(cases) - len(skipped) - len(bad)
    print(f"junit: {len(cases)} '{keyword}' tests: {passed} passed, {len(skipped)} skipped, {len(bad)} failed")
    if bad:
        return 1
    if passed == 0:
        print(f"junit: no '{keyword}' test ran (all skipped or none collected): nothing was tested")
        return 1
    reasons = [(c.find("skipped").get("message") or "")[:200] for c in skipped]
    bad = [r for r in reasons if no_skips or (bad_skips and re.search(bad_skips, r))]
    if bad:
        print(f"junit: {len(bad)} skipped, which counts as failed here: {'; '.join(sorted(set(bad)))}")
        return 1
    return 0


def sanitizer(log: Path, rc: int) -> int:
    """A probe run of compute-sanitizer on a trivial kernel: 0 supported, 3 unsupported here, 1 otherwise."""
    text = log.read_text(errors="replace") if log.exists() else ""
    if rc == 0:
        print("sanitizer: supported")
        return 0
    if UNSUPPORTED.search(text):
        line = next(ln for ln in text.splitlines() if UNSUPPORTED.search(ln))
        print(f"sanitizer: unsupported on this machine ({line.strip()})")
        return 3
    print(f"sanitizer: the probe failed (rc {rc}); see the log")
    return 1


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="check", required=True)
    pre = sub.add_parser("preflight")
    pre.add_argument("work", type=Path)
    pre.add_argument("--dry-run", action="store_true")
    ker = sub.add_parser("kernels")
    ker.add_argument("--device", choices=("cpu", "cuda"), required=True)
    jun = sub.add_parser("junit")
    jun.add_argument("file", type=Path)
    jun.add_argument("--keyword", required=True)
    jun.add_argument("--no-skips", action="store_true")
    jun.add_argument("--bad-skips", help="a regex: a skip whose reason matches it fails the step")
    san = sub.add_parser("sanitizer")
    san.add_argument("log", type=Path)
    san.add_argument("rc", type=int)
    a = p.parse_args(argv)
    if a.check == "preflight":
        return preflight(a.work, a.dry_run)
    if a.check == "kernels":
        return kernels(a.device)
    if a.check == "junit":
        return junit(a.file, a.keyword, a.no_skips, a.bad_skips)
    return sanitizer(a.log, a.rc)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
