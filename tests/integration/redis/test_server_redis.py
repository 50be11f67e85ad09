"""The server with a Redis L2: adapters land under versioned keys; a dead Redis never fails a request."""

from __future__ import annotations

import secrets

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone

pytestmark = pytest.mark.redis


def metric(client: httpx.Client, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_generation_fills_l2_under_the_versioned_key(tmp_path):
    redis = pytest.importorskip("redis")
    r = redis.Redis(host="127.0.0.1", port=6379, socket_timeout=0.5)
    try:
        r.ping()
    except redis.RedisError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    prefix = f"polyserve-test-{secrets.token_hex(4)}"
    store = build_store(tmp_path / "store")
    settings = settings_for(tmp_path, redis_url="redis://127.0.0.1:6379/0", redis_prefix=prefix, warmup=False)
    try:
        with live_server(settings, tiny_backbone()) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
            assert c.post("/v1/generate", json={"task": "alpha", "prompt": "x", "max_new_tokens": 2}).status_code == 200
            record = store.get_task("alpha")
            key = srv.runtime.cache.key(record)
            assert key.startswith(f"{prefix}:v1:{srv.runtime.backbone.fingerprint}:")
            # the native engine caches a routed task as its routing weights, under the ":w" key
            assert key.endswith(f":alpha:{record.cache_version}:w")
            assert r.exists(key) and r.ttl(key) > 0
            assert metric(c, "polyserve_adapter_cache_requests_total", tier="l2", result="miss") == 1
    finally:
        for k in r.scan_iter(f"{prefix}:*"):
            r.delete(k)
        r.close()


def test_dead_redis_still_serves_and_counts_errors(tmp_path):
    build_store(tmp_path / "store")
    settings = settings_for(tmp_path, redis_url="redis://127.0.0.1:1/0", redis_breaker_failures=2, warmup=False)
    with live_server(settings, tiny_backbone()) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        for task in ("alpha", "beta", "gamma"):
            r = c.post("/v1/generate", json={"task": task, "prompt": "x", "max_new_tokens": 2})
            assert r.status_code == 200
        assert metric(c, "polyserve_redis_errors_total") >= 2
        assert srv.runtime.l2.breaker.state == "open"
