"""L2 entries are authenticated: an HMAC-SHA256 under a secret the replicas share, over the entry's
key and bytes. Redis is reachable by more than the replicas (and compose's Redis had no password):
without this, a writer to Redis could replace any task's adapter for every replica, since a
decoded entry is only checked for names, shapes and finiteness.

    sealed = MAGIC + HMAC(secret, key + 0x00 + payload) + payload
    unseal(secret, key, sealed) -> payload, or ValueError (unsealed, forged, altered, or an entry
                                   moved to another key): the caller counts a corrupt miss

The secret is POLYSERVE_CACHE_SECRET when set, else one the store generates once and keeps (a
directory store: `cache-secret`, mode 600, under its root; PostgreSQL: a row of store_meta):
replicas sharing a store share it, a Redis-only writer cannot read it.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from adapters_store.store.contract import AdapterStore

MAGIC = b"psa1"
TAG_BYTES = 32


def _tag(secret: bytes, key: str, payload: bytes) -> bytes:
    return hmac.new(secret, key.encode() + b"\x00" + payload, hashlib.sha256).digest()


def seal(secret: bytes, key: str, payload: bytes) -> bytes:
    return MAGIC + _tag(secret, key, payload) + payload


def unseal(secret: bytes, key: str, data: bytes) -> bytes:
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + TAG_BYTES:
        raise ValueError(f"cached adapter {key!r}: not a sealed entry")
    tag, payload = data[len(MAGIC):len(MAGIC) + TAG_BYTES], data[len(MAGIC) + TAG_BYTES:]
    if not hmac.compare_digest(tag, _tag(secret, key, payload)):
        raise ValueError(f"cached adapter {key!r}: authentication failed (forged or altered)")
    return payload


def cache_secret(configured: str | None, store: AdapterStore) -> bytes:
    """POLYSERVE_CACHE_SECRET, else the store's own secret, made once by the first node that asks
    (`AdapterStore.shared_secret`: a mode-600 file under a directory store's root, a row of a
    PostgreSQL store), so every node of one store signs and checks with the same key."""
    if configured:
        return configured.encode()
    return store.shared_secret("cache-secret")
