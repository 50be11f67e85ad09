"""Cross-replica change notification over the real Redis, and the re-scan fallback."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from server.fleet.replicas import ReplicaSync
from tests.support.server_fixtures import redis_up

REDIS = "redis://127.0.0.1:6379/0"



@pytest.mark.redis
@pytest.mark.skipif(not redis_up(), reason="needs the real Redis at 127.0.0.1:6379 (.ci/run starts it)")
def test_a_change_published_by_one_replica_reaches_the_other_within_a_second():
    channel = f"polyserve:test:{uuid.uuid4().hex}"
    seen: list[str | None] = []
    got = threading.Event()

    def on_change(task):  # a message is a hint: it brings the store re-scan forward
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
        assert seen == [None]
    finally:
        a.stop()
        b.stop()


@pytest.mark.redis
@pytest.mark.skipif(not redis_up(), reason="needs the real Redis at 127.0.0.1:6379 (.ci/run starts it)")
def test_a_flood_of_messages_causes_a_bounded_number_of_rescans_and_names_nothing():
    """Anyone who can write to Redis can publish: 2000 messages (well-formed for made-up tasks, and
    garbage) in a burst cause at most one re-scan per hint_interval, and no task is ever acted on
    by name (each re-scan re-reads the store, which drops only what changed)."""
    import redis

    channel = f"polyserve:test:{uuid.uuid4().hex}"
    calls: list[str | None] = []
    b = ReplicaSync(REDIS, calls.append, replica_id="b", channel=channel, rescan_every=60, hint_interval=0.1)
    b.start()
    client = redis.Redis.from_url(REDIS)
    try:
        assert b.subscribed.wait(2)
        started = time.monotonic()
        pipe = client.pipeline(transaction=False)
        for i in range(1000):
            pipe.publish(channel, f'{{"task": "victim-{i}", "replica": "x"}}')
            pipe.publish(channel, "not json {")
        pipe.execute()
        deadline = time.monotonic() + 10
        while b.hints < 1000 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        elapsed = time.monotonic() - started
        assert b.hints == 1000  # the garbage is no hint
        assert calls and all(c is None for c in calls)
        assert len(calls) <= elapsed / 0.1 + 2, (len(calls), elapsed)
    finally:
        b.stop()
        client.close()


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
