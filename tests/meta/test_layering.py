"""The layering docs/architecture.md promises, checked on the source: every import, lazy ones and
`if TYPE_CHECKING:` ones too, and every dotted string that names one of our modules (the console
script loads each package's commands by name with importlib: server/cli.py).

    client          imports nothing of ours (it talks HTTP)
    adapters_store  imports neither server nor training (the math and the store sit at the bottom)
    training        never imports server
    server          imports training only where registration jobs run and where the shipped
                    inventory is installed (server/jobs/, server/fleet/worker/,
                    server/wiring/runtime.py) and in the console script that joins every
                    package's commands (server/cli.py); the HTTP layer (server/api/) and the
                    engines (server/engines/) never do
    server/api/     the thin FastAPI shell: no module of server/ outside it imports it, but
                    the one that starts the app (server/wiring/serve_cli.py). Domain code raises
                    domain errors; server/api/errors.py maps them to statuses
    no circles      between any two modules of ours
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
OURS = ("client", "adapters_store", "training", "server")


def module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def our_modules(root: Path) -> dict[str, Path]:
    """Every module of the four packages, by dotted name (a package by its face, __init__.py)."""
    return {module_name(root, p): p for top in OURS if (root / top).is_dir() for p in (root / top).rglob("*.py")}


def module_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that `path` imports, at any depth of its code. `from a.b import c` is an
    import of a.b.c where that is a module, else of a.b; a relative import is resolved against the
    module's package; a string constant that names one of our modules is an import by name."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                and node.value in modules:  # a dotted name: "training" alone is a word (a status)
            found.add(node.value)
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = our_modules(root)
    return {name: module_imports(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def package_offenders(root: Path, folder: str, forbidden: set[str],
                      allowed: tuple[str, ...] = ()) -> dict[str, set[str]]:
    """Modules under `folder` (outside the `allowed` path prefixes) that import a top-level package
    in `forbidden`."""
    modules = our_modules(root)
    out = {}
    for name, path in sorted(modules.items()):
        rel = path.relative_to(root).as_posix()
        if not rel.startswith(folder + "/") or rel.startswith(allowed):
            continue
        bad = {m.split(".")[0] for m in module_imports(name, path, modules)} & forbidden
        if bad:
            out[rel] = bad
    return out


def http_reachers(root: Path, allowed: frozenset[str] = frozenset({"server/wiring/serve_cli.py"})) -> list[str]:
    """Modules of server/ outside server/api/ that import the HTTP layer."""
    modules = our_modules(root)
    reaching = []
    for name, path in sorted(modules.items()):
        rel = path.relative_to(root).as_posix()
        if not rel.startswith("server/") or rel.startswith("server/api/") or rel in allowed:
            continue
        if any(m == "server.api" or m.startswith("server.api.") for m in module_imports(name, path, modules)):
            reaching.append(rel)
    return reaching


# -- the rules, on this repository ----------------------------------------------------------------

@pytest.mark.parametrize(("folder", "forbidden", "allowed"), [
    ("client", {"adapters_store", "training", "server"}, ()),
    ("adapters_store", {"training", "server"}, ()),
    ("training", {"server"}, ()),
    ("server", {"training"}, ("server/jobs/", "server/fleet/worker/", "server/wiring/runtime.py", "server/cli.py")),
    ("server/api", {"training"}, ()),
    ("server/engines", {"training"}, ()),
])
def test_imports_point_one_way(folder, forbidden, allowed):
    assert package_offenders(ROOT, folder, forbidden, allowed) == {}


def test_no_import_circles():
    assert circles(import_graph(ROOT)) == []


def test_only_the_http_shell_imports_the_http_layer():
    assert http_reachers(ROOT) == []


def test_package_roots_hold_only_their_face():
    """adapters_store/ is rooms (lora/, store/, backbone/, interop/, tools/) under a face; server/'s
    root holds its face and the console script."""
    assert sorted(p.name for p in (ROOT / "adapters_store").glob("*.py")) == ["__init__.py"]
    assert sorted(p.name for p in (ROOT / "server").glob("*.py")) == ["__init__.py", "cli.py"]


def test_the_console_script_is_read_by_name():
    """server/cli.py loads each package's commands with importlib: the check sees those names."""
    graph = import_graph(ROOT)
    assert {"training.cli", "client.cli", "adapters_store.tools.cli"} <= graph["server.cli"]


# -- the checks catch what they claim, on small trees built here -----------------------------------

def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for top in OURS:
        (root / top).mkdir(exist_ok=True)
        (root / top / "__init__.py").touch()
    return root


def test_a_circle_is_found_lazy_typed_or_by_name(tmp_path):
    root = _tree(tmp_path, {
        "server/a.py": "from server import b\n",
        "server/b.py": "def f():\n    from server.c import x\n",
        "server/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from server.a import y\n",
        "server/d.py": "import importlib\nMODS = ['server.e']\n",
        "server/e.py": "from . import d\n",
        "server/f.py": "import server.a\n",
    })
    assert circles(import_graph(root)) == [["server.a", "server.b", "server.c"], ["server.d", "server.e"]]


def test_a_domain_module_importing_the_http_layer_is_found(tmp_path):
    root = _tree(tmp_path, {
        "server/api/errors.py": "class ApiError(Exception): ...\n",
        "server/registry/tasks.py": "def f():\n    from server.api.errors import ApiError\n",
        "server/jobs/service.py": "from server.registry import tasks\n",
        "server/wiring/serve_cli.py": "from server.api import errors\n",
    })
    assert http_reachers(root) == ["server/registry/tasks.py"]


def test_a_forbidden_package_is_found_lazily_and_by_name(tmp_path):
    root = _tree(tmp_path, {
        "training/adapt.py": "",
        "server/api/a.py": "def f():\n    from training.adapt import x\n",
        "server/api/b.py": "COMMANDS = {'training.adapt': ['x']}\n",
        "server/api/c.py": "import server.api.a\n",
    })
    assert package_offenders(root, "server/api", {"training"}) == {
        "server/api/a.py": {"training"}, "server/api/b.py": {"training"}}
