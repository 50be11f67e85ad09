"""The package layering the README promises, checked on the source (every import, lazy ones too):

    client          imports nothing of ours (it talks HTTP)
    adapters_store  imports neither server nor training (the math and the store sit at the bottom)
    training        never imports server
    server          imports training only where registration jobs run and where the shipped
                    inventory is installed (server/jobs/, server/fleet/worker/, server/wiring/runtime.py); the
                    HTTP layer (server/api/) and the engines (server/engines/) never do
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("client", "adapters_store", "training", "server")


def imports_of(path: Path) -> set[str]:
    """Top-level packages of ours that the module imports, at any depth of its code."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(name.split(".")[0] for name in names if name.split(".")[0] in OURS)
    return found


def offenders(folder: str, forbidden: set[str], allowed_files: tuple[str, ...] = ()) -> dict[str, set[str]]:
    out = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(allowed_files):
            continue
        bad = imports_of(path) & forbidden
        if bad:
            out[rel] = bad
    return out


@pytest.mark.parametrize(("folder", "forbidden", "allowed"), [
    ("client", {"adapters_store", "training", "server"}, ()),
    ("adapters_store", {"training", "server"}, ()),
    ("training", {"server"}, ()),
    ("server", {"training"}, ("server/jobs/", "server/fleet/worker/", "server/wiring/runtime.py")),
])
def test_imports_point_one_way(folder, forbidden, allowed):
    assert offenders(folder, forbidden, allowed) == {}


def test_the_http_layer_and_the_engines_never_reach_training():
    assert offenders("server/api", {"training"}) == {}
    assert offenders("server/engines", {"training"}) == {}


def test_the_check_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from training.adapt import Adaptation\n    import server.api.app\n")
    assert imports_of(module) == {"training", "server"}


def modules_imported(path: Path) -> set[str]:
    """Every dotted module path the file imports (lazy imports too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def test_only_the_http_shell_imports_the_http_layer():
    """server/api/ is the thin FastAPI shell over the rest: registration, task resolution, the
    engines and the worker never reach into it (ApiError lives in server/errors.py for them). The
    exceptions: serve_cli starts the app; jobs/schemas.py holds the jobs' wire shapes."""
    allowed = {"server/wiring/serve_cli.py", "server/api/job_schemas.py"}
    reaching = sorted(
        path.relative_to(ROOT).as_posix() for path in (ROOT / "server").rglob("*.py")
        if not path.relative_to(ROOT).as_posix().startswith("server/api/")
        and path.relative_to(ROOT).as_posix() not in allowed
        and any(m == "server.api" or m.startswith("server.api.") for m in modules_imported(path)))
    assert reaching == []
