"""Redis misbehaving under load never costs a request: a black-holed Redis (accepts, never
answers), a slow one (answers after the socket timeout), and one stopped and restarted mid-load.
Every request must be answered 200; L2 is consulted on every request (L1 off) so Redis is on the
hot path the whole time. Own redis-server / sockets on free ports: the shared Redis is not touched."""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server_fixtures import (
    TASKS,
    build_store,
    free_port,
    live_server,
    settings_for,
    tiny_backbone,
)
from tests.tools import chaos  # the same misbehaving Redis as `python -m tests.tools.chaos`

black_hole, slow_proxy, start_redis = chaos.black_hole, chaos.slow_proxy, chaos.start_redis


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
