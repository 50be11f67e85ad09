"""The public names do not move when the code does: the CLI, the settings, the HTTP API, the
metrics, the directory store's files and the PostgreSQL schema, compared with a snapshot
(tests/meta/public_surface.json) that was taken from the code before the packages were
restructured.

A deliberate change to the public surface updates the snapshot in the same commit, after the
contract (docs/contract.md) says so:

    .venv/bin/python -m tests.meta.test_public_surface --write
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

SNAPSHOT = Path(__file__).with_name("public_surface.json")


def cli_surface() -> dict[str, list[str]]:
    """Every command path of `polyserve` and its parameters (option strings, argument names)."""
    from server.cli import main

    out: dict[str, list[str]] = {}

    def walk(cmd: click.Command, path: str) -> None:
        params = []
        for p in cmd.params:
            params.extend(p.opts + p.secondary_opts if isinstance(p, click.Option) else [f"<{p.name}>"])
        out[path] = sorted(params)
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                walk(sub, f"{path} {name}")

    walk(main, "polyserve")
    return out


def settings_surface() -> list[str]:
    """Every POLYSERVE_* variable the process reads: the settings' and the tuning switches' (one
    variable each, not POLYSERVE_TUNING)."""
    from server.engines.native.tuning import Tuning
    from server.wiring.settings import Settings

    prefix = Settings.model_config.get("env_prefix", "")
    names = [f"{prefix}{name}".upper() for name in Settings.model_fields if name != "tuning"]
    return sorted(names + Tuning.env_names())


def http_surface() -> dict[str, Any]:
    """Every route and method, and every wire schema's fields, from the app's OpenAPI document."""
    from server.api.app import create_app
    from server.wiring.settings import Settings

    with tempfile.TemporaryDirectory() as store:  # the app is built, never started: the store stays empty
        doc = create_app(Settings(backbone="tiny", store=store)).openapi()
    routes = sorted(f"{method.upper()} {path}" for path, item in doc["paths"].items() for method in item)
    schemas = {name: sorted(schema.get("properties", {}))
               for name, schema in doc.get("components", {}).get("schemas", {}).items()}
    return {"routes": routes, "schemas": schemas}


def metrics_surface() -> list[str]:
    from server.infra.metrics import Metrics

    return sorted({m.name for m in Metrics().registry.collect()})


def store_surface() -> dict[str, list[str]]:
    """A small directory store's files (relative paths) and each JSON file's top-level keys."""
    from tests.support.server_fixtures import build_store

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_store(root, tasks=("t1",))
        out: dict[str, list[str]] = {}
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = re.sub(r"-[0-9a-f]{16}\b", "-<digest>", path.relative_to(root).as_posix())
            keys = sorted(json.loads(path.read_text())) if path.suffix == ".json" else []
            out[rel] = keys
        return out


def pg_schema_surface() -> str:
    from adapters_store.store.postgres_schema import MIGRATIONS

    return hashlib.sha256(json.dumps(MIGRATIONS).encode()).hexdigest()


def surface() -> dict[str, Any]:
    return {"cli": cli_surface(), "settings": settings_surface(), "http": http_surface(),
            "metrics": metrics_surface(), "store": store_surface(), "pg_schema": pg_schema_surface()}


def test_the_public_surface_is_the_snapshot():
    want = json.loads(SNAPSHOT.read_text())
    got = json.loads(json.dumps(surface()))
    for part in want:
        assert got[part] == want[part], f"the public {part} changed (see this module's docstring)"
    assert set(got) == set(want)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        SNAPSHOT.write_text(json.dumps(surface(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {SNAPSHOT}")
    else:
        print(json.dumps(surface(), indent=1, sort_keys=True))
