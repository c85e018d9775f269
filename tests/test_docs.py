"""The README stays a user's page: short, the two commands first, and nothing links out of the repository."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README_LIMIT_BYTES = 12_500  # "about 12 KB": measurements belong in docs/performance.md, not here
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_readme_is_short():
    size = (REPO / "README.md").stat().st_size
    assert size <= README_LIMIT_BYTES, f"README.md is {size} bytes; move details into docs/ (limit {README_LIMIT_BYTES})"


def test_readme_starts_with_the_setup_and_the_test_command_that_ci_runs():
    text = (REPO / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert first_block is not None and text.index("```bash") < text.index("\n## "), "the commands come first"
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines() if line.strip()]
    assert commands[0].startswith("bash scripts/setup.sh && "), commands
    assert commands[1] == ".venv/bin/python -m pytest -q", commands
    ci = (REPO / ".ci" / "run").read_text()
    # CI runs that command under coverage: scripts/coverage.sh runs the same pytest with the same interpreter
    coverage_sh = (REPO / "scripts" / "coverage.sh").read_text()
    assert "bash scripts/setup.sh" in ci and "bash scripts/coverage.sh" in ci
    assert "py=.venv/bin/python" in coverage_sh and "$py -m coverage run -m pytest -q" in coverage_sh


def test_docs_link_only_inside_the_repository():
    for page in DOCS:
        text = page.read_text()
        outside = re.findall(r"https?://\S+", text)
        assert not outside, f"{page.relative_to(REPO)} links outside the repository: {outside[:3]}"
        for target in re.findall(r"\]\(([^)#]+)", text):
            assert (page.parent / target).exists(), f"{page.relative_to(REPO)} links to a missing {target}"
