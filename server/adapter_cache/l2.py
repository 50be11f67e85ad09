"""L2: materialised adapters as safetensors bytes in Redis, under versioned keys with a TTL.

    polyserve:v1:{backbone_fingerprint}:{inventory_version}:{task}:{record.cache_version}

Redis is only a cache: every call fails open (short socket timeouts; errors return None and
count in redis_errors_total), and a circuit breaker skips Redis while it is known to be down.
"""

from __future__ import annotations

import logging
from typing import Any, cast

from server.adapter_cache.breaker import CircuitBreaker
from server.infra.metrics import Metrics

log = logging.getLogger("polyserve.cache")


def adapter_key(prefix: str, fingerprint: str, inventory_version: str, task: str, cache_version: str) -> str:
    return f"{prefix}:v1:{fingerprint}:{inventory_version}:{task}:{cache_version}"


class RedisTier:
    def __init__(self, url: str, *, ttl_seconds: int, socket_timeout: float, connect_timeout: float,
                 breaker: CircuitBreaker, metrics: Metrics | None = None, client: Any = None) -> None:
        import redis

        self.ttl = ttl_seconds
        self.breaker = breaker
        self.metrics = metrics
        self.client = client or redis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout,
            retry_on_timeout=False, health_check_interval=0,
        )

    def _failed(self, op: str, err: Exception) -> None:
        if self.metrics is not None:
            self.metrics.redis_errors.inc()
        if self.breaker.record_failure():
            log.warning("redis %s failed (%s); circuit breaker open for %.0fs", op, err, self.breaker.cooldown)

    def get(self, key: str) -> bytes | None | Exception:
        """bytes on a hit, None on a miss; the exception (not raised) when Redis failed or was skipped."""
        if not self.breaker.allow():
            return ConnectionError("redis circuit breaker open")
        try:
            value = self.client.get(key)
        except Exception as err:  # noqa: BLE001 — redis.RedisError, OSError, timeouts: fail open
            self._failed("get", err)
            return err
        self.breaker.record_success()
        return cast(bytes | None, value)  # no decode_responses: Redis answers bytes

    def set(self, key: str, data: bytes) -> bool:
        if not self.breaker.allow():
            return False
        try:
            self.client.set(key, data, ex=self.ttl)
        except Exception as err:  # noqa: BLE001 — fail open
            self._failed("set", err)
            return False
        self.breaker.record_success()
        return True

    def delete(self, key: str) -> bool:
        """Drop a key (a deleted task); versioned keys make this an optimisation, not a necessity."""
        if not self.breaker.allow():
            return False
        try:
            removed = bool(self.client.delete(key))
        except Exception as err:  # noqa: BLE001 — fail open
            self._failed("delete", err)
            return False
        self.breaker.record_success()
        return removed

    def close(self) -> None:
        try:
            self.client.close()
        except Exception as err:  # noqa: BLE001 — closing a broken connection must not fail shutdown
            log.debug("redis close failed: %s", err)
