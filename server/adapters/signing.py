"""L2 entries are authenticated: an HMAC-SHA256 under a secret the replicas share, over the entry's
key and bytes. Redis is reachable by more than the replicas (and compose's Redis had no password):
without this, a writer to Redis could replace any task's adapter for every replica, since a
decoded entry is only checked for names, shapes and finiteness.

    sealed = MAGIC + HMAC(secret, key + 0x00 + payload) + payload
    unseal(secret, key, sealed) -> payload, or ValueError (unsealed, forged, altered, or an entry
                                   moved to another key): the caller counts a corrupt miss

The secret is POLYSERVE_CACHE_SECRET when set, else one generated once into the store directory
(`cache-secret`, mode 600): replicas sharing a store share it, a Redis-only writer cannot read it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Any

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


def cache_secret(configured: str | None, store_root: str | Path, store: Any = None) -> bytes:
    """POLYSERVE_CACHE_SECRET, else the store's own secret (created once, atomically): one the
    store backend keeps (PostgreSQL: in the database, for nodes that share no directory), else a
    file under the store's root."""
    if configured:
        return configured.encode()
    kept = store.shared_secret("cache-secret") if store is not None else None
    if kept is not None:
        return kept
    path = Path(store_root) / "cache-secret"
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    tmp = path.with_name(f".cache-secret.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)  # the first replica wins; the others read its secret
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_bytes()
