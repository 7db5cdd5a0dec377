#!/usr/bin/env python3
"""Writes docs/seams.md ("What combines with what") from the seam matrix (tests/seams/_seam_table.py, _seam_known.py).

Run it after changing the table: `python scripts/seams_doc.py`; tests/seams/test_seams_table.py fails while
the committed page differs from what this writes.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "seams"), str(ROOT / "tests")]

from _seam_page import render  # noqa: E402

PAGE = ROOT / "docs" / "seams.md"

if __name__ == "__main__":
    PAGE.write_text(render())
    print(f"wrote {PAGE.relative_to(ROOT)}")
