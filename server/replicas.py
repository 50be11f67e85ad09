"""Keep several server processes that share one store (and one Redis) in agreement.

A replica that registers, finishes or deletes a task publishes {"task", "replica"} on a Redis
channel; every replica subscribes and calls `on_change(task)`, which reloads that task from the
store (the source of truth) and drops its cached adapters. Without Redis — or while it is down —
a periodic re-scan of the store (`on_change(None)`) is the fallback, so a change is seen within
~`rescan_every` seconds either way. Redis is only a message bus here: nothing is lost if a
message is, because the store is re-read.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable

from server import openmp

log = logging.getLogger(__name__)


class ReplicaSync:
    def __init__(
        self,
        redis_url: str | None,
        on_change: Callable[[str | None], None],
        *,
        replica_id: str,
        channel: str = "polyserve:v1:tasks",
        rescan_every: float = 1.0,
        on_redis_error: Callable[[], None] = lambda: None,
    ) -> None:
        self.redis_url = redis_url
        self.on_change = on_change
        self.replica_id = replica_id
        self.channel = channel
        self.rescan_every = rescan_every
        self.on_redis_error = on_redis_error
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._client = None
        self.subscribed = threading.Event()
        if redis_url:
            import redis

            self._client = redis.Redis.from_url(redis_url, socket_timeout=0.5, socket_connect_timeout=0.5)

    def start(self) -> None:
        self._threads = [threading.Thread(target=_one_thread(self._rescan_loop), name="polyserve-rescan", daemon=True)]
        if self._client is not None:
            self._threads.append(threading.Thread(target=_one_thread(self._listen_loop), name="polyserve-pubsub",
                                                  daemon=True))
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)
        if self._client is not None:
            self._client.close()

    def publish(self, task: str) -> None:
        """Tell the other replicas that `task` changed; fails open (the re-scan catches up)."""
        if self._client is None:
            return
        try:
            self._client.publish(self.channel, json.dumps({"task": task, "replica": self.replica_id}))
        except Exception:  # noqa: BLE001 - Redis is a best-effort bus
            self.on_redis_error()
            log.warning("could not publish task change for %r; other replicas will see it on re-scan", task)

    def _rescan_loop(self) -> None:
        while not self._stop.wait(self.rescan_every):
            try:
                self.on_change(None)
            except Exception:  # keep the loop alive
                log.exception("store re-scan failed")

    def _listen_loop(self) -> None:
        assert self._client is not None
        while not self._stop.is_set():
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.channel)
                self.subscribed.set()
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=0.2)
                    if message is None:
                        continue
                    data = json.loads(message["data"])
                    if data.get("replica") != self.replica_id:
                        self.on_change(str(data["task"]))
            except Exception:  # noqa: BLE001 - reconnect after a pause
                self.subscribed.clear()
                self.on_redis_error()
                self._stop.wait(1.0)
            finally:
                try:
                    pubsub.close()
                except Exception:
                    log.debug("closing a broken pubsub connection failed", exc_info=True)


def _one_thread(loop):
    """A thread body that runs torch on one thread (no OpenMP pool beside the engine's: server/openmp.py)."""

    def run() -> None:
        openmp.one_thread()
        loop()

    return run
