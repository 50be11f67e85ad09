"""Cross-replica change notification over the real Redis, and the re-scan fallback."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from server.replicas import ReplicaSync
from tests.server_fixtures import redis_up

REDIS = "redis://127.0.0.1:6379/0"



@pytest.mark.redis
@pytest.mark.skipif(not redis_up(), reason="needs the real Redis at 127.0.0.1:6379 (.ci/run starts it)")
def test_a_change_published_by_one_replica_reaches_the_other_within_a_second():
    channel = f"polyserve:test:{uuid.uuid4().hex}"
    seen: list[str | None] = []
    got = threading.Event()

    def on_change(task):
        if task is not None:
            seen.append(task)
            got.set()

    a = ReplicaSync(REDIS, lambda t: None, replica_id="a", channel=channel, rescan_every=60)
    b = ReplicaSync(REDIS, on_change, replica_id="b", channel=channel, rescan_every=60)
    a.start()
    b.start()
    try:
        assert b.subscribed.wait(2)
        started = time.monotonic()
        a.publish("new-task")
        assert got.wait(1.0), "no notification within 1 s"
        print(f"notification latency: {(time.monotonic() - started) * 1000:.1f} ms")
        assert seen == ["new-task"]
    finally:
        a.stop()
        b.stop()


def test_without_redis_the_periodic_rescan_runs():
    calls: list[str | None] = []
    sync = ReplicaSync(None, calls.append, replica_id="a", rescan_every=0.05)
    sync.start()
    time.sleep(0.3)
    sync.publish("ignored")  # no bus: a no-op, not an error
    sync.stop()
    assert calls and all(c is None for c in calls)


def test_dead_redis_fails_open_and_counts_errors():
    errors = []
    sync = ReplicaSync("redis://127.0.0.1:1/0", lambda t: None, replica_id="a", rescan_every=60,
                       on_redis_error=lambda: errors.append(1))
    sync.publish("t")
    assert errors == [1]
    sync.stop()
