"""README holds what mkdocs' strict build does not check: its example runs as printed, its links resolve,
and its test command is the one CI runs. (The docs site itself is checked by `mkdocs build --strict` in .ci/run.)
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

pytestmark = pytest.mark.skipif(not README.exists(), reason="needs the source tree (README.md)")


def _readme() -> str:
    return README.read_text()


def _section(text: str, heading: str) -> str:
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README has no '## {heading}' section"
    return match.group(1)


def test_readme_example_runs_and_prints_what_its_comment_says():
    blocks = re.findall(r"```python\n(.*?)```", _section(_readme(), "Example"), re.S)
    assert len(blocks) == 1, "README's Example section should hold exactly one python block"
    code = blocks[0]
    promised = re.search(r"# (\d+ \d+ \w+)\s*$", code.strip().splitlines()[-1])
    assert promised, "the example's last line should end with a comment of what it prints"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md:Example", "exec"), {"__name__": "readme_example"})
    assert out.getvalue().strip() == promised.group(1)


def test_readme_links_resolve():
    text = _readme()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links, "README should link to the docs"
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README links to {link}, which is not in the tree"
        if anchor:
            # mkdocs' toc slugs: lowercase, punctuation dropped, spaces to hyphens.
            slugs = {
                re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", h.strip().lower()))
                for h in re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            }
            assert anchor in slugs, f"README links to {link}, but {path} has no heading with that anchor"


def test_readme_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    command = "./scripts/quickstart.sh test"
    assert f"GRADACC_VENV=.venv-ci {command}\n" in ci, ".ci/run no longer runs README's test command"
    quick_start = _section(_readme(), "Quick start")
    assert re.search(rf"^{re.escape(command)}\s+#", quick_start, re.M), "README's Quick start lost the CI command"


def test_readme_stays_short():
    assert len(_readme().splitlines()) <= 300, "README is the front page: move details into docs/"
