"""Keep several server processes that share one store (and one Redis) in agreement.

A replica that registers, finishes or deletes a task publishes {"task", "replica"} on a Redis
channel; every replica subscribes and calls `on_change(task)`, which reloads that task from the
store (the source of truth) and drops its cached adapters. Without Redis — or while it is down —
a periodic re-scan of the store (`on_change(None)`) is the fallback, so a change is seen within
~`rescan_every` seconds either way. Redis is only a message bus here: nothing is lost if a
message is, because the store is re-read.

A message is only a hint, never trusted: whoever can write to Redis can publish. A hint (any
well-formed message from another replica) brings the next store re-scan forward, `on_change(None)`,
which drops only what really changed in the store. Hints are debounced and rate-limited: a burst
of any size causes at most one re-scan per `hint_interval` seconds.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

from server.infra import openmp

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
        hint_interval: float = 0.1,
    ) -> None:
        self.hint_interval = hint_interval
        self.hints = 0  # well-formed hints received (tests, logs)
        self.rescans_for_hints = 0
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
                pending, last = False, 0.0
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=self.hint_interval / 2)
                    if message is not None and _is_hint(message.get("data"), self.replica_id):
                        self.hints += 1
                        pending = True
                    now = time.monotonic()
                    if pending and now - last >= self.hint_interval:
                        pending, last = False, now
                        self.rescans_for_hints += 1
                        try:
                            self.on_change(None)
                        except Exception:  # keep listening
                            log.exception("store re-scan failed")
            except Exception:  # noqa: BLE001 - reconnect after a pause
                self.subscribed.clear()
                self.on_redis_error()
                self._stop.wait(1.0)
            finally:
                try:
                    pubsub.close()
                except Exception:
                    log.debug("closing a broken pubsub connection failed", exc_info=True)


def _is_hint(data: object, me: str) -> bool:
    """A well-formed change message from another replica (its content is never acted on)."""
    try:
        message = json.loads(data)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return isinstance(message, dict) and isinstance(message.get("task"), str) and message.get("replica") != me


def _one_thread(loop):
    """A thread body that runs torch on one thread (no OpenMP pool beside the engine's: server/infra/openmp.py)."""

    def run() -> None:
        openmp.one_thread()
        loop()

    return run
