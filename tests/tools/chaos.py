"""Chaos run against real server processes (the reliability targets), one scenario per fresh server:

    poison        8 requests on a task in flight + one with temperature 1e-38 -> codes, poison latency
    redis-restart Redis killed and restarted (own redis-server) during 8-client load -> non-200 count
    redis-hole    Redis black-holed (a port that accepts and never answers) during load -> non-200
    burst         600 simultaneous requests -> status histogram, server RSS before / after
    sigterm       SIGTERM with 16 requests in flight -> every request 200 or 503, none hangs

    .venv/bin/python -m tests.tools.chaos                       # tiny backbone, ~1-2 minutes
    .venv/bin/python -m tests.tools.chaos --backbone default    # the real default backbone

The shared Redis at 127.0.0.1:6379 is never touched. Prints one line per scenario and a verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


# -- misbehaving Redis ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def black_hole() -> Iterator[int]:
    """A TCP port that accepts connections and never says a word."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    srv.settimeout(0.1)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except TimeoutError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join()
        for s in held:
            s.close()
        srv.close()


@contextmanager
def slow_proxy(target_port: int, delay: float) -> Iterator[int]:
    """A TCP proxy to a real Redis that delays every reply by `delay` seconds."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    srv.settimeout(0.1)
    stop = threading.Event()

    def pipe(src: socket.socket, dst: socket.socket, wait: float) -> None:
        try:
            while data := src.recv(65536):
                time.sleep(wait)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def accept() -> None:
        while not stop.is_set():
            try:
                client = srv.accept()[0]
            except TimeoutError:
                continue
            upstream = socket.create_connection(("127.0.0.1", target_port))
            threading.Thread(target=pipe, args=(client, upstream, 0.0), daemon=True).start()
            threading.Thread(target=pipe, args=(upstream, client, delay), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join()
        srv.close()


def start_redis(port: int) -> subprocess.Popen:
    """An own redis-server (no persistence) on `port`, answering."""
    if shutil.which("redis-server") is None:
        raise RuntimeError("no redis-server binary")
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


# -- a server process ----------------------------------------------------------------------------
@contextmanager
def server(backbone: str, redis_url: str | None = None, **env: str) -> Iterator[tuple[str, subprocess.Popen]]:
    with tempfile.TemporaryDirectory(prefix="polyserve-chaos-") as tmp:
        from tests.support.server_fixtures import build_store

        if backbone == "tiny":
            build_store(Path(tmp) / "store")
        port = free_port()
        environ = {**os.environ,
                   "POLYSERVE_HOME": os.environ.get("POLYSERVE_HOME", str(Path.home() / ".cache/polyserve")),
                   "POLYSERVE_STORE": str(Path(tmp) / "store"), "POLYSERVE_BACKBONE": backbone,
                   "POLYSERVE_L1_CACHE_BYTES": "0", "POLYSERVE_REDIS_BREAKER_COOLDOWN": "0.5", **env}
        environ.pop("POLYSERVE_REDIS_URL", None)
        if redis_url:
            environ["POLYSERVE_REDIS_URL"] = redis_url
        proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--port", str(port)], env=environ,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 300
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}")
                try:
                    if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.time() > deadline:
                    raise TimeoutError("server not ready")
                time.sleep(0.2)
            yield url, proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()


def task_of(url: str) -> str:
    tasks = [t["id"] for t in httpx.get(f"{url}/v1/tasks").json()["data"] if t["status"] == "ready"]
    return tasks[0] if tasks else "base"


def load(url: str, seconds: float, during=None, clients: int = 8) -> list[int]:
    codes: list[int] = []
    end = time.time() + seconds
    task = task_of(url)

    def worker(i: int) -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            n = 0
            while time.time() < end:
                try:
                    codes.append(c.post("/v1/generate", json={"task": task, "prompt": f"x {i} {n}",
                                                              "max_new_tokens": 8}).status_code)
                except httpx.HTTPError:
                    codes.append(-1)  # no answer at all
                n += 1

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(worker, i) for i in range(clients)]
        if during is not None:
            during()
        for f in futures:
            f.result()
    return codes


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def in_engine(url: str) -> float:
    """Requests running + waiting in the engine, from the server's own gauges."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
        if family.name in ("polyserve_requests_running", "polyserve_requests_waiting"):
            total += sum(s.value for s in family.samples)
    return total


def summary(codes: list[int]) -> str:
    return ", ".join(f"{n} x {c if c >= 0 else 'no answer'}" for c, n in sorted(collections.Counter(codes).items()))


# -- scenarios -------------------------------------------------------------------------------------
def poison(backbone: str) -> bool:
    with server(backbone) as (url, _):
        task = task_of(url)

        async def go() -> tuple[list[int], int, float]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                good = [c.post("/v1/generate", json={"task": task, "prompt": f"p{i}", "max_new_tokens": 32})
                        for i in range(8)]
                started = time.perf_counter()

                async def bad() -> tuple[int, float]:
                    r = await c.post("/v1/generate", json={"task": task, "prompt": "p", "temperature": 1e-38,
                                                           "max_new_tokens": 32})
                    return r.status_code, time.perf_counter() - started

                results = await asyncio.gather(*good, bad())
                return [r.status_code for r in results[:-1]], *results[-1]

        codes, bad_code, bad_s = asyncio.run(go())
    ok = codes == [200] * 8 and bad_code in (200, 422) and bad_s < 5
    print(f"poison:        8 in flight -> {summary(codes)}; poison -> {bad_code} in {bad_s:.2f} s  "
          f"[{'ok' if ok else 'FAIL'}]")
    return ok


def redis_restart(backbone: str, seconds: float) -> bool:
    port = free_port()
    proc = start_redis(port)
    try:
        with server(backbone, f"redis://127.0.0.1:{port}/0") as (url, _):
            def chaos() -> None:
                nonlocal proc
                time.sleep(seconds / 3)
                proc.kill()
                proc.wait()
                time.sleep(seconds / 3)
                proc = start_redis(port)

            codes = load(url, seconds, chaos)
    finally:
        proc.kill()
        proc.wait()
    ok = bool(codes) and set(codes) == {200}
    print(f"redis-restart: {len(codes)} requests over {seconds:.0f} s, Redis killed at 1/3 and restarted at 2/3 -> "
          f"{summary(codes)}  [{'ok' if ok else 'FAIL'}]")
    return ok


def redis_hole(backbone: str, seconds: float) -> bool:
    with black_hole() as port, server(backbone, f"redis://127.0.0.1:{port}/0") as (url, _):
        codes = load(url, seconds)
    ok = bool(codes) and set(codes) == {200}
    print(f"redis-hole:    {len(codes)} requests over {seconds:.0f} s with Redis black-holed -> {summary(codes)}  "
          f"[{'ok' if ok else 'FAIL'}]")
    return ok


def burst(backbone: str, n: int = 600) -> bool:
    with server(backbone) as (url, proc):
        task = task_of(url)
        before = rss_mib(proc.pid)

        async def go() -> list[int]:
            limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c:
                async def one(i: int) -> int:
                    try:
                        r = await c.post("/v1/generate", json={"task": task, "prompt": f"b{i}", "max_new_tokens": 8})
                        return r.status_code
                    except httpx.HTTPError:
                        return -1
                return list(await asyncio.gather(*(one(i) for i in range(n))))

        codes = asyncio.run(go())
        after = rss_mib(proc.pid)
    ok = set(codes) <= {200, 429} and 200 in codes
    print(f"burst:         {n} simultaneous -> {summary(codes)}; server RSS {before:.0f} -> {after:.0f} MiB "
          f"(+{after - before:.0f})  [{'ok' if ok else 'FAIL'}]")
    return ok


def sigterm(backbone: str) -> bool:
    with server(backbone) as (url, proc):
        task = task_of(url)
        codes: list[int] = []

        def one(i: int) -> None:
            try:
                r = httpx.post(f"{url}/v1/generate", json={"task": task, "prompt": f"s{i}", "max_new_tokens": 256},
                               timeout=60)
                codes.append(r.status_code)
            except httpx.HTTPError:
                codes.append(-1)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        deadline = time.time() + 30
        while in_engine(url) < 16:  # all 16 really in flight (not still connecting) before the signal
            if time.time() > deadline:
                raise RuntimeError("the 16 requests never were in flight together")
            time.sleep(0.01)
        started = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(90)
        hung = sum(t.is_alive() for t in threads)
        proc.wait(60)
        exit_s = time.perf_counter() - started
    ok = hung == 0 and set(codes) <= {200, 503}
    print(f"sigterm:       16 in flight -> {summary(codes)}, {hung} hung; server exited {exit_s:.1f} s after "
          f"SIGTERM  [{'ok' if ok else 'FAIL'}]")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backbone", default="tiny")
    ap.add_argument("--seconds", type=float, default=15.0, help="load duration of the Redis scenarios")
    ap.add_argument("--only", nargs="*", default=["poison", "redis-restart", "redis-hole", "burst", "sigterm"])
    args = ap.parse_args()
    results = {}
    for name in args.only:
        if name == "poison":
            results[name] = poison(args.backbone)
        elif name == "redis-restart":
            results[name] = redis_restart(args.backbone, args.seconds)
        elif name == "redis-hole":
            results[name] = redis_hole(args.backbone, args.seconds)
        elif name == "burst":
            results[name] = burst(args.backbone)
        elif name == "sigterm":
            results[name] = sigterm(args.backbone)
        else:
            raise SystemExit(f"unknown scenario {name!r}")
    failed = [n for n, ok in results.items() if not ok]
    print("verdict:", "all targets met" if not failed else f"FAILED: {', '.join(failed)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
