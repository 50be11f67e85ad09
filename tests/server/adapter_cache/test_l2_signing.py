"""L2 entries are authenticated (server/adapter_cache/signing.py): a forged entry (a well-formed adapter
written to Redis by someone without the secret), an altered one, or a valid one moved under
another task's key is a counted corrupt miss, served from the store and overwritten."""

from __future__ import annotations

import os

import pytest
import torch

from server.adapter_cache import codec, signing
from server.adapter_cache.cache import AdapterCache
from server.adapter_cache.l1 import L1Cache
from tests.integration.redis.test_cache_tiers import counter, env, redis_tier  # noqa: F401 - fixtures

SECRET = b"replicas-share-this"


def make_cache(env, tier, metrics, prefix, secret=SECRET) -> AdapterCache:  # noqa: F811
    store, bb, info, skills = env
    return AdapterCache(store, info, skills, fingerprint=bb.fingerprint, device=torch.device("cpu"),
                        dtype=torch.float32, l1=L1Cache(1 << 30), l2=tier, prefix=prefix, metrics=metrics,
                        secret=secret)


def test_seal_round_trip_and_what_it_refuses():
    sealed = signing.seal(SECRET, "k1", b"payload")
    assert signing.unseal(SECRET, "k1", sealed) == b"payload"
    for bad_secret, key, data in [(b"other", "k1", sealed), (SECRET, "k2", sealed),
                                  (SECRET, "k1", sealed[:-1] + b"X"), (SECRET, "k1", b"payload")]:
        with pytest.raises(ValueError):
            signing.unseal(bad_secret, key, data)


def test_the_store_secret_is_made_once_and_private(tmp_path):
    """A directory store keeps its secret in a mode-600 file under its root; a second process on
    the same directory reads the same one."""
    from adapters_store.store.directory import DirectoryStore

    first = signing.cache_secret(None, DirectoryStore(tmp_path))
    assert len(first) == 32 and signing.cache_secret(None, DirectoryStore(tmp_path)) == first
    assert os.stat(tmp_path / "cache-secret").st_mode & 0o077 == 0
    assert signing.cache_secret("configured", DirectoryStore(tmp_path)) == b"configured"



@pytest.mark.redis
@pytest.mark.parametrize("attack", ["forged", "altered", "other-task", "unsealed"])
def test_an_entry_not_sealed_by_a_replica_is_a_counted_corrupt_miss(env, redis_tier, attack):  # noqa: F811
    tier, prefix, metrics, client = redis_tier
    store = env[0]
    record, other = store.get_task("alpha"), store.get_task("beta")
    cache = make_cache(env, tier, metrics, prefix)
    key = cache.key(record)
    # a well-formed adapter of the right shapes, with other weights (beta's): decodes fine
    evil = codec.encode(cache.materialize(other, key))
    if attack == "forged":
        entry = signing.seal(b"guessed-secret", key, evil)
    elif attack == "altered":
        good = signing.seal(SECRET, key, codec.encode(cache.materialize(record, key)))
        entry = good[:-8] + bytes(8)
    elif attack == "other-task":
        entry = signing.seal(SECRET, cache.key(other), evil)  # valid for beta's key, replayed under alpha's
    else:
        entry = evil
    client.set(key, entry)
    adapter = cache.get(record)
    assert counter(metrics, "l2", "corrupt") == 1 and counter(metrics, "l2", "hit") == 0
    fresh = cache.materialize(record)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(adapter.layers, fresh.layers, strict=True))
    assert signing.unseal(SECRET, key, client.get(key))  # overwritten with a sealed good copy
    # and a replica with the secret then hits it
    again = make_cache(env, tier, metrics, prefix)
    again.get(record)
    assert counter(metrics, "l2", "hit") == 1
