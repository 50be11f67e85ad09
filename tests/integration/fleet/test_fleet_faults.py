"""Fleet faults against real servers of the test's own, over real HTTP:

- PostgreSQL restarted under load: tasks the replica holds keep serving through it; tasks it
  does not hold, reads and registrations answer 503 store_unavailable while it is down; all of
  them recover by themselves; the job accepted before the restart still succeeds.
- Redis down: a replica whose POLYSERVE_REDIS_URL points at a Redis that goes away keeps serving
  held and new tasks, registers, and still sees another replica's changes (LISTEN/NOTIFY).

Each test starts its own PostgreSQL (tests/support/pg_instance.py) or redis-server on a free port: the
shared ones at 5432 / 6379 are never stopped.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from adapters_store.store import open_store
from tests.integration.redis.test_redis_chaos import l2_counts, needs_redis_server, start_redis
from tests.support.pg_instance import own_postgres
from tests.support.pg_utils import temp_database
from tests.support.server_fixtures import (
    build_store,
    free_port,
    live_server,
    put_task,
    settings_for,
    tiny_backbone,
)

EXAMPLES = [{"input": f"w{i} x{i}", "output": f"x{i} w{i}"} for i in range(12)]


def _fill(dsn: str, src_root: Path) -> None:
    """The PostgreSQL store holds what the directory store at src_root holds (alpha..delta)."""
    src = build_store(src_root)
    store = open_store(dsn)
    info, skills = src.inventory_bytes()
    store.import_inventory(info, skills)
    for record in src.list_tasks():
        store.import_task(record, src.weights_bytes(record))
    store.close()  # type: ignore[attr-defined]


def _gen(c: httpx.Client, task: str, prompt: str = "a b") -> httpx.Response:
    return c.post("/v1/generate", json={"task": task, "prompt": prompt, "max_new_tokens": 4})


class Load:
    """One client sending generations for `tasks` back to back until stopped; keeps every status."""

    def __init__(self, url: str, tasks: tuple[str, ...]) -> None:
        self.codes: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, tasks), daemon=True)
        self._thread.start()

    def _run(self, url: str, tasks: tuple[str, ...]) -> None:
        with httpx.Client(base_url=url, timeout=30) as c:
            n = 0
            while not self._stop.is_set():
                self.codes.append(_gen(c, tasks[n % len(tasks)], f"x {n}").status_code)
                n += 1

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join(60)
        return self.codes


def _wait_status(c: httpx.Client, job_id: str, wanted: set[str], timeout: float) -> dict:
    deadline = time.time() + timeout
    while True:
        job = c.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in wanted:
            return job
        assert time.time() < deadline, job
        time.sleep(0.1)


def _unavailable(r: httpx.Response) -> bool:
    return r.status_code == 503 and r.json()["error"]["type"] == "store_unavailable" and "Retry-After" in r.headers


@pytest.mark.slow
def test_postgres_restarted_under_load(tmp_path):
    with own_postgres() as pg:
        dsn = pg.create_database("polyserve")
        _fill(dsn, tmp_path / "src")
        with live_server(settings_for(tmp_path, store=dsn), backbone=tiny_backbone()) as srv, \
                httpx.Client(base_url=srv.url, timeout=30) as c:
            held = {t: _gen(c, t).json()["text"] for t in ("alpha", "beta")}  # now this replica holds them
            # a job accepted before the restart that is still training when the database goes away
            job = c.post("/v1/tasks",
                         json={"task": "accepted", "method": "routing", "examples": EXAMPLES, "steps": 250})
            assert job.status_code == 202, job.text
            job_id = job.json()["id"]
            _wait_status(c, job_id, {"running"}, timeout=60)
            load = Load(srv.url, ("alpha", "beta"))
            time.sleep(0.5)
            pg.stop("fast")  # every session ended, as in a restart
            down_at = time.time()
            try:
                assert not pg.running()
                # down for 8 s: long enough that a pool left to its reconnect back-off (1, 2, 4, 8 s)
                # would still be waiting when the database is back
                while time.time() - down_at < 8:
                    t0 = time.perf_counter()
                    assert _unavailable(_gen(c, "gamma")), "a task this replica never read"
                    assert time.perf_counter() - t0 < 2.0, "a 503 must not wait out the pool's timeout"
                    assert _unavailable(c.get("/v1/tasks/delta"))
                    assert _unavailable(c.post("/v1/tasks", json={"task": "refused", "examples": EXAMPLES}))
                    for task, text in held.items():
                        r = _gen(c, task)
                        assert r.status_code == 200 and r.json()["text"] == text
                    time.sleep(0.5)
                status = c.get(f"/v1/jobs/{job_id}").json()["status"]
            finally:
                pg.start()
            deadline = time.time() + 4  # recovers by itself, at once: no restart of the replica
            while (cold := _gen(c, "gamma")).status_code != 200:
                assert _unavailable(cold) and time.time() < deadline, cold.text
                time.sleep(0.2)
            assert c.get("/v1/tasks/delta").status_code == 200
            codes = load.stop()
            assert codes and set(codes) == {200}, f"{len(codes)} requests: {sorted(set(codes))}"
            assert status == "running", "the job must have trained through the outage for this test to mean it"
            done = _wait_status(c, job_id, {"succeeded", "failed", "cancelled"}, timeout=180)
            assert done["status"] == "succeeded", done
            assert _gen(c, "accepted").status_code == 200
            again = c.post("/v1/tasks", json={"task": "after", "examples": EXAMPLES, "method": "retrieve"})
            assert again.status_code == 202
            assert _wait_status(c, again.json()["id"], {"succeeded", "failed"}, timeout=120)["status"] == "succeeded"


@needs_redis_server
def test_redis_down_a_replica_keeps_serving_registering_and_seeing_changes(tmp_path):
    """L1 off, so Redis (L2) is on every request's path until it dies; re-scans a minute apart,
    so only LISTEN/NOTIFY can carry another replica's changes once Redis is gone."""
    port = free_port()
    redis = start_redis(port)
    try:
        with temp_database() as dsn:
            _fill(dsn, tmp_path / "src")
            settings = settings_for(tmp_path, store=dsn, redis_url=f"redis://127.0.0.1:{port}/0", l1_cache_bytes=0,
                                    redis_breaker_cooldown=0.5, rescan_seconds=60)
            with live_server(settings, backbone=tiny_backbone()) as srv, \
                    httpx.Client(base_url=srv.url, timeout=30) as c:
                before = {t: _gen(c, t).json()["text"] for t in ("alpha", "beta")}
                _gen(c, "alpha")
                assert l2_counts(srv.url).get("hit", 0) > 0  # Redis really serves adapters here
                redis.kill()
                redis.wait()
                load = Load(srv.url, ("alpha", "beta", "gamma"))  # gamma: never materialised before
                time.sleep(2.0)
                assert _gen(c, "alpha").json()["text"] == before["alpha"]
                other = open_store(dsn)  # another replica's changes, with no Redis to announce them
                try:
                    other.delete_task("delta")
                    put_task(other, "beta", seed=11)
                finally:
                    other.close()  # type: ignore[attr-defined]
                deadline = time.time() + 2.0
                while "delta" in {m["id"] for m in c.get("/v1/models").json()["data"]} \
                        or _gen(c, "beta").json()["text"] == before["beta"]:
                    assert time.time() < deadline, "a change made elsewhere did not arrive without Redis"
                    time.sleep(0.05)
                assert _gen(c, "delta").status_code == 404
                job = c.post("/v1/tasks", json={"task": "while-down", "examples": EXAMPLES, "method": "retrieve"})
                assert job.status_code == 202, job.text
                assert _wait_status(c, job.json()["id"], {"succeeded", "failed"}, timeout=120)["status"] == "succeeded"
                assert _gen(c, "while-down").status_code == 200
                codes = load.stop()
                counts = l2_counts(srv.url)
    finally:
        redis.kill()
        redis.wait()
    assert codes and set(codes) == {200}, f"{len(codes)} requests: {sorted(set(codes))}"
    assert counts.get("error", 0) > 0  # the dead Redis was on the path, and failed open


def test_nodes_of_a_postgresql_store_share_one_l2_secret_with_no_shared_directory():
    """The directory store keeps its L2 signing key in a file under its root; nodes of a
    PostgreSQL store share no directory, so the database keeps it (made once, by the first)."""
    from server.adapter_cache.signing import cache_secret

    with temp_database() as dsn:
        a, b = open_store(dsn), open_store(dsn)
        try:
            first = cache_secret(None, a)
            assert len(first) == 32 and cache_secret(None, b) == first
            assert cache_secret("configured", a) == b"configured"
        finally:
            a.close()  # type: ignore[attr-defined]
            b.close()  # type: ignore[attr-defined]
