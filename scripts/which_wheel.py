"""Says which gradacc_ext wheel fits this machine, before anything is installed (plain Python 3.10+, no torch import).

    python scripts/which_wheel.py

Reads glibc, the NVIDIA driver (libcuda's cuDriverGetVersion, and device 0's compute capability), and the
installed torch's release and CUDA (torch/version.py, not imported), and prints the wheel to take and why:
the install table of docs/install.md. `gradacc info` prints the same once a wheel is installed. The rules live
in gradacc_ext/cli/wheel_choice.py, loaded here by path so that gradacc_ext need not be installed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

MODULE = Path(__file__).resolve().parents[1] / "gradacc_ext" / "cli" / "wheel_choice.py"


def main() -> int:
    spec = importlib.util.spec_from_file_location("wheel_choice", MODULE)
    assert spec is not None and spec.loader is not None, MODULE
    wheel_choice = importlib.util.module_from_spec(spec)
    sys.modules["wheel_choice"] = wheel_choice  # dataclasses look their module up while the class is made
    spec.loader.exec_module(wheel_choice)
    print("\n".join(wheel_choice.describe(wheel_choice.probe())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
