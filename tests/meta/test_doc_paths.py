"""Every repository path a doc names exists.

What counts as a path (``doc_paths``):
- a token that starts with one of the repository's top-level directories and a slash
  (``server/api/app.py``, ``bench/``, ``docs/history/``), wherever it stands: in prose,
  in backticks, in a command line. A token preceded by ``/``, ``.``, ``~``, ``$``, ``:`` or a word
  character is not one (``/tmp/bench/x``, ``../other/docs/x.md``, ``.venv/bin``; ``REV:path``
  names a file of an earlier commit, as ``git show`` takes it: history notes cite removed files so);
- a top-level file named as a word (``Makefile``, ``pyproject.toml``, ``docker-compose.yml``);
- the target of a relative markdown link or image (``[x](routing.png)``), from the doc's folder.

A token is cut at whitespace, a backtick, a quote or a bracket; then ``::test`` and ``:line``
suffixes and trailing punctuation are stripped. Tokens holding ``<``, ``{``, ``*`` or ``$`` are
placeholders or patterns and are skipped. A path may name a file or a folder.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TOP_DIRS = ("adapters_store", "bench", "client", "docker", "docs", "scripts", "server", "tests",
            "training", ".ci")
TOP_FILES = ("Makefile", "pyproject.toml", "docker-compose.yml", "README.md", "BENCHMARKS.md")

_DIR_TOKEN = re.compile(
    r"(?<![\w./~$:-])(?:" + "|".join(re.escape(d) for d in TOP_DIRS) + r")/[^\s`'\"()\[\]|,;]*"
)
_FILE_TOKEN = re.compile(
    r"(?<![\w./~$-])(?:" + "|".join(re.escape(f) for f in TOP_FILES) + r")(?![\w./-]*\w)"
)
_LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_PLACEHOLDER = re.compile(r"[<>{}*$]")


def _clean(token: str) -> str:
    token = token.split("::", 1)[0]
    token = re.sub(r":\d.*$", "", token)
    return token.rstrip(".,;:!?)")


def doc_paths(text: str) -> set[str]:
    """Repository paths (relative to the root) that ``text`` names, placeholders skipped."""
    found = set()
    for match in _DIR_TOKEN.finditer(text):
        token = match.group(0)
        if _PLACEHOLDER.search(token):
            continue
        found.add(_clean(token))
    found.update(m.group(0) for m in _FILE_TOKEN.finditer(text))
    return found


def link_targets(text: str) -> set[str]:
    """Relative markdown link and image targets, anchors stripped; URLs and anchors skipped."""
    targets = set()
    for match in _LINK.finditer(text):
        target = match.group(1).split("#", 1)[0]
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target) or _PLACEHOLDER.search(target):
            continue
        targets.add(target)
    return targets


def missing_paths(doc: Path) -> list[str]:
    text = doc.read_text(encoding="utf-8")
    missing = [p for p in doc_paths(text) if not (ROOT / p).exists()]
    missing += [t for t in link_targets(text) if not (doc.parent / t).exists()]
    return sorted(set(missing))


def _docs() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    missing = missing_paths(doc)
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("see `server/app.py:12`.", {"server/app.py"}),
        ("`tests/server/engines/test_fair.py::test_x` and bench/serve_bench.py --tasks 4,", {
            "tests/server/engines/test_fair.py", "bench/serve_bench.py"}),
        ("(training/adapt.py DEFAULTS)", {"training/adapt.py"}),
        ("under server/engines/native/.", {"server/engines/native/"}),
        ("run `make test` (Makefile), pyproject.toml", {"Makefile", "pyproject.toml"}),
        ("/tmp/bench/x.py ../other/docs/a.md .venv/bin ~/server/x $HOME/docs/y", set()),
        ("docs/history/<topic>.md, server/{a,b}.py, tests/test_*.py", set()),
        ("POLYSERVE_HOME=docs/ x", {"docs/"}),
        ("`git show 9a07e87:server/infra/old.py` (removed), not server/x.py", {"server/x.py"}),
    ],
)
def test_extraction_rule(text: str, expected: set[str]) -> None:
    assert doc_paths(text) == expected


def test_a_made_up_path_is_caught(tmp_path: Path) -> None:
    doc = tmp_path / "made_up.md"
    doc.write_text(
        "The plan lives in `server/engine/lora_plan.py:40`; see also [plot](nowhere.png) and "
        "server/api/app.py.\n",
        encoding="utf-8",
    )
    assert missing_paths(doc) == ["nowhere.png", "server/engine/lora_plan.py"]


# -- the same rule over the code's own docstrings ---------------------------------------------------

CODE_DIRS = ("server", "adapters_store", "client", "training", "bench", "scripts", "tests")


def docstrings(path: Path) -> list[str]:
    """The module's, its classes' and its functions' docstrings."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    nodes = [tree, *(n for n in ast.walk(tree)
                     if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))]
    return [doc for doc in (ast.get_docstring(n, clean=False) for n in nodes) if doc]


def missing_in_docstrings(path: Path) -> list[str]:
    named = set().union(*(doc_paths(doc) for doc in docstrings(path)))
    return sorted(p for p in named if not (ROOT / p).exists())


def _modules() -> list[Path]:
    return sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py"))


def test_every_path_a_docstring_names_exists() -> None:
    missing = {str(p.relative_to(ROOT)): m for p in _modules() if (m := missing_in_docstrings(p))}
    assert not missing, f"docstrings name paths that do not exist: {missing}"


def test_a_made_up_path_in_a_docstring_is_caught(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text('"""Reads server/registry/tasks.py."""\n\n\nclass A:\n'
                      '    def f(self):\n        """Then server/registry/task.py."""\n', encoding="utf-8")
    assert missing_in_docstrings(module) == ["server/registry/task.py"]
