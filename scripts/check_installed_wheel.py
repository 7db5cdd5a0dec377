"""Asserts that an installed gradacc_ext wheel is what Python imports, with its compiled extension loaded.

    python scripts/check_installed_wheel.py [--variant cpu|cuda] [--torch VERSION]

Run it from a folder that holds no gradacc_ext/ (the cwd would shadow the wheel; this script's own folder
does not). --variant: the wheel must (cuda) or must not (cpu) hold CUDA kernels. --torch: the running torch
must still be that release (installing the wheel must not have replaced it). Beside a CUDA torch, a CUDA
wheel must find torch's current-stream function (csrc/cuda/stream.cpp), which needs no GPU to check.
Prints where gradacc_ext came from, built vs running versions, and build_info(). Used by .ci/run's wheel
stage and scripts/torch_matrix.sh.
"""

from __future__ import annotations

import argparse
import json

import torch

import gradacc_ext


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=["cpu", "cuda"], help="whether the wheel holds CUDA kernels")
    parser.add_argument("--torch", help="the torch release that must be running, e.g. 2.11.0")
    args = parser.parse_args()
    info = gradacc_ext.build_info()
    assert "site-packages" in gradacc_ext.__file__, gradacc_ext.__file__
    assert gradacc_ext.extension_loaded(), info
    if args.torch:
        assert torch.__version__.split("+")[0] == args.torch, f"torch {torch.__version__} replaced {args.torch}"
    if args.variant:
        assert info["with_cuda"] == (args.variant == "cuda"), info
    print("gradacc_ext from", gradacc_ext.__file__)
    print(
        f"built with torch {info['built_torch_version']} (CUDA {info['built_cuda_version']}), "
        f"running torch {info['running_torch_version']} (CUDA {info['running_cuda_version']})"
    )
    if info["with_cuda"] and torch.version.cuda:
        # The lookup the CUDA _C makes at its first CUDA op (no GPU here to run one), as _C itself reports it.
        assert info["cuda_stream"] == "ok", info["cuda_stream"]
        print(
            "CUDA wheel beside a CUDA torch: aoti_torch_get_current_cuda_stream resolves in the loaded libtorch_cuda.so"
        )
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
