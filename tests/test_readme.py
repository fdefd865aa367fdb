"""The README is a front door (issue 39): at most 300 lines, none over 200 characters; the
reference material lives in docs/ (its links are checked by tests/test_cli.py)."""

from __future__ import annotations

from helpers import REPO


def test_the_readme_is_short_and_its_lines_readable():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines (at most 300: move detail to docs/)"
    long = [f"{i}: {len(line)} characters" for i, line in enumerate(lines, 1) if len(line) > 200]
    assert not long, "README.md lines over 200 characters:\n" + "\n".join(long)
