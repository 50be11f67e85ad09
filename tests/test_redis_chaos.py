"""Redis misbehaving under load never costs a request: a black-holed Redis (accepts, never
answers), a slow one (answers after the socket timeout), and one stopped and restarted mid-load.
Every request must be answered 200; L2 is consulted on every request (L1 off) so Redis is on the
hot path the whole time. Own redis-server / sockets on free ports: the shared Redis is not touched."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_fixtures import TASKS, build_store, free_port, live_server, settings_for, tiny_backbone


@contextmanager
def black_hole():
    """A TCP port that accepts connections and never says a word."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.1)
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
def slow_proxy(target_port: int, delay: float):
    """Forwards to a real Redis, delaying every reply by `delay` seconds."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
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
                try:
                    s.close()
                except OSError:
                    pass

    def accept() -> None:
        srv.settimeout(0.1)
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


needs_redis_server = pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server binary")


def load(url: str, seconds: float, during=None, clients: int = 8) -> list[int]:
    """`clients` threads sending generations for `seconds`; `during()` runs meanwhile."""
    codes: list[int] = []
    end = time.time() + seconds

    def worker(i: int) -> None:
        with httpx.Client(base_url=url, timeout=30) as c:
            n = 0
            while time.time() < end:
                r = c.post("/v1/generate", json={"task": TASKS[(i + n) % len(TASKS)], "prompt": f"x {n}",
                                                 "max_new_tokens": 4})
                codes.append(r.status_code)
                n += 1

    with ThreadPoolExecutor(clients + 1) as pool:
        futures = [pool.submit(worker, i) for i in range(clients)]
        if during is not None:
            during()
        for f in futures:
            f.result()
    return codes


def l2_counts(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "polyserve_adapter_cache_requests_total" and s.labels.get("tier") == "l2":
                out[s.labels["result"]] = out.get(s.labels["result"], 0.0) + s.value
    return out


def serve(tmp_path, redis_url: str):
    build_store(tmp_path / "store")
    return live_server(settings_for(tmp_path, redis_url=redis_url, l1_cache_bytes=0,
                                    redis_breaker_cooldown=0.5), backbone=tiny_backbone())


@pytest.mark.parametrize("kind", ["black-holed", "slow"])
def test_unresponsive_redis_costs_no_request(tmp_path, kind):
    if kind == "slow":
        if shutil.which("redis-server") is None:
            pytest.skip("no redis-server binary")
        port = free_port()
        proc = start_redis(port)
        ctx = slow_proxy(port, delay=0.5)  # 10x the socket timeout
    else:
        proc, ctx = None, black_hole()
    try:
        with ctx as bad_port, serve(tmp_path, f"redis://127.0.0.1:{bad_port}/0") as srv:
            codes = load(srv.url, seconds=4)
            counts = l2_counts(srv.url)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    assert codes and set(codes) == {200}, f"{len(codes)} requests: {sorted(set(codes))}"
    assert counts.get("error", 0) > 0  # Redis really was on the path, and failed open
    assert counts.get("hit", 0) == 0


@needs_redis_server
def test_redis_stopped_and_restarted_during_load(tmp_path):
    port = free_port()
    proc = start_redis(port)
    try:
        with serve(tmp_path, f"redis://127.0.0.1:{port}/0") as srv:
            def chaos() -> None:
                nonlocal proc
                time.sleep(1.5)
                proc.kill()
                proc.wait()
                time.sleep(1.5)
                proc = start_redis(port)  # an empty Redis on the same port

            codes = load(srv.url, seconds=6, during=chaos)
            before = l2_counts(srv.url)
            load(srv.url, seconds=1.5)  # after the breaker's cooldown L2 is used again
            after = l2_counts(srv.url)
    finally:
        proc.kill()
        proc.wait()
    assert codes and set(codes) == {200}, f"{len(codes)} requests: {sorted(set(codes))}"
    assert before.get("error", 0) > 0
    assert after.get("hit", 0) > before.get("hit", 0)  # back to serving from L2
