"""Current docs say what is true now: they cite no commit hash and no issue number (those belong in
docs/history/, where a note may name the commit its figures came from). The code's comments and
docstrings cite no issue number either, and name no commit as the place an explanation lives."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ISSUE = re.compile(r"\bissues?[ -]?#?\d+", re.IGNORECASE)
# a commit hash: 7-12 hex digits holding at least one digit and one letter (variant letters such as
# `abEFefdc` hold no digit; counts and dates hold no letter)
HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}\b")
CODE_COMMIT = re.compile(
    r"\b(?:commit|git archive|git checkout|worktree of|before|after) " + HASH.pattern[2:])
CODE_DIRS = ("server", "adapters_store", "client", "training", "bench", "scripts", "tests")


def current_docs() -> list[Path]:
    docs = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [d for d in docs if d.exists()]


def citations(text: str) -> list[str]:
    return [m.group(0) for pattern in (ISSUE, HASH) for m in pattern.finditer(text)]


def code_citations(text: str) -> list[str]:
    return [m.group(0) for pattern in (ISSUE, CODE_COMMIT) for m in pattern.finditer(text)]


def test_current_docs_cite_no_commit_or_issue() -> None:
    found = {str(d.relative_to(ROOT)): c for d in current_docs()
             if (c := citations(d.read_text(encoding="utf-8")))}
    assert not found, f"current docs cite commits or issues (history goes to docs/history/): {found}"


def test_the_code_cites_no_issue_or_commit() -> None:
    found = {}
    for d in CODE_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue
            if c := code_citations(path.read_text(encoding="utf-8")):
                found[str(path.relative_to(ROOT))] = c
    assert not found, f"code cites issues or commits: {found}"


def test_what_counts_as_a_citation() -> None:
    assert citations("as issue 45 asked; issue-13 protocol; fixed in 4f8bcd5 (2026-11-30)") == [
        "issue 45", "issue-13", "4f8bcd5"]
    assert citations("--variants abEFefdc, 2,585 lines, 2026-11-30, 16384 tokens, deadbeef") == []
    assert code_citations("git archive e820ff5 | tar; the path before 7e80846; issue #10") == [
        "issue #10", "git archive e820ff5", "before 7e80846"]
