"""`polyserve serve` in a subprocess on a free local port, for the benchmarks that go through HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def polyserve_server(env: dict[str, str], ready_s: float = 300, *, command: str = "serve",
                     prefix: tuple[str, ...] = ()) -> Iterator[str]:
    """Starts the server with os.environ + env, yields its base URL once /ready answers 200, stops it.
    command: "serve" or "worker"; prefix: what runs it, e.g. ("taskset", "-c", "0") to pin it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "server.cli", command, "--host", "127.0.0.1",
                             "--port", str(port)],
                            env={**os.environ, **env}, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while True:
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not become ready (exit code {proc.poll()})")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
