"""Adapter cache tiers: L1 LRU by bytes, the breaker, the Redis L2 (real Redis at 127.0.0.1:6379)."""

from __future__ import annotations

import secrets

import pytest
import torch

from server.adapter_cache import codec
from server.adapter_cache.breaker import CircuitBreaker
from server.adapter_cache.cache import AdapterCache
from server.adapter_cache.l1 import L1Cache
from server.adapter_cache.l2 import RedisTier, adapter_key
from server.adapter_cache.types import Adapter
from server.infra.metrics import Metrics
from tests.support.server_fixtures import build_store, put_task, tiny_backbone

REDIS_URL = "redis://127.0.0.1:6379/0"


def fake(key: str, nbytes: int, task: str = "t") -> Adapter:
    return Adapter(task, key, "lora", [(torch.zeros(nbytes // 4), torch.zeros(0))])


def test_l1_lru_eviction_by_bytes_step_by_step():
    l1 = L1Cache(capacity_bytes=1000)
    assert l1.add(fake("a", 400)) and l1.keys() == ["a"] and l1.bytes == 400
    assert l1.add(fake("b", 400)) and l1.keys() == ["a", "b"]
    assert l1.get("a") is not None and l1.keys() == ["b", "a"]  # a is now most recent
    assert l1.add(fake("c", 400)) and l1.keys() == ["a", "c"]  # b (LRU) evicted to fit
    assert l1.bytes == 800
    assert not l1.add(fake("huge", 2000)) and l1.keys() == ["a", "c"]  # larger than capacity: not cached
    assert l1.add(fake("d", 1000)) and l1.keys() == ["d"] and l1.bytes == 1000
    assert l1.discard("d") and not l1.discard("d") and l1.bytes == 0
    assert l1.add(fake("x1", 100, task="x")) and l1.add(fake("x2", 100, task="x")) and l1.add(fake("y", 100, "y"))
    assert l1.discard_task("x") == 2 and l1.keys() == ["y"]


def test_breaker_state_machine():
    now = [0.0]
    b = CircuitBreaker(threshold=2, cooldown=5.0, clock=lambda: now[0])
    assert b.allow() and b.state == "closed"
    assert not b.record_failure() and b.state == "closed"
    assert b.record_failure() and b.state == "open"
    assert not b.allow()
    now[0] = 5.0
    assert b.allow() and b.state == "half_open"
    assert not b.allow()  # one trial at a time
    assert b.record_failure() and b.state == "open"
    now[0] = 10.0
    assert b.allow() and b.record_success() and b.state == "closed"
    assert not b.record_success()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    store = build_store(tmp_path_factory.mktemp("cache-store"))
    bb = tiny_backbone()
    info, skills = store.load_inventory(bb.fingerprint)
    return store, bb, info, skills


def make_cache(env, l2=None, metrics=None, capacity=1 << 30, prefix="polyserve", routing_layers=True) -> AdapterCache:
    store, bb, info, skills = env
    return AdapterCache(store, info, skills, fingerprint=bb.fingerprint, device=torch.device("cpu"),
                        dtype=torch.float32, l1=L1Cache(capacity), l2=l2, prefix=prefix, metrics=metrics,
                        routing_layers=routing_layers)


def test_key_scheme_is_versioned(env):
    store, bb, info, _ = env
    record = store.get_task("alpha")
    assert make_cache(env).key(record) == (
        f"polyserve:v1:{bb.fingerprint}:{info.version}:alpha:{record.cache_version}")
    assert adapter_key("p", "fp", "inv", "t", "3-abc") == "p:v1:fp:inv:t:3-abc"


def test_codec_roundtrip_and_rejects_foreign_bytes(env):
    store, _, info, _ = env
    cache = make_cache(env)
    adapter = cache.materialize(store.get_task("beta"))
    back = codec.decode(codec.encode(adapter), adapter.key, "beta", "routing", info, torch.device("cpu"), torch.float32)
    for (a1, b1), (a2, b2) in zip(adapter.layers, back.layers, strict=True):
        assert torch.equal(a1, a2) and torch.equal(b1, b2)
    assert torch.equal(adapter.weights, back.weights)
    from safetensors.torch import save

    with pytest.raises(ValueError):
        codec.decode(save({"0.A": torch.zeros(3, 3)}), "k", "beta", "routing", info, torch.device("cpu"), torch.float32)


def test_l1_state_transitions(env):
    store, *_ = env
    cache = make_cache(env)
    record = store.get_task("gamma")
    assert cache.state(record) == "absent"
    adapter = cache.get(record)
    assert cache.state(record) == "resident" and cache.get(record) is adapter
    assert cache.forget("gamma") == 1 and cache.state(record) == "absent"


@pytest.fixture
def redis_tier():
    redis = pytest.importorskip("redis")
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=0.5)
    try:
        client.ping()
    except redis.RedisError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    prefix = f"polyserve-test-{secrets.token_hex(4)}"
    metrics = Metrics()
    tier = RedisTier(REDIS_URL, ttl_seconds=60, socket_timeout=0.5, connect_timeout=0.5,
                     breaker=CircuitBreaker(3, 10.0), metrics=metrics)
    yield tier, prefix, metrics, client
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)
    tier.close()
    client.close()


def counter(metrics: Metrics, tier: str, result: str) -> float:
    return metrics.adapter_cache.labels(tier=tier, result=result)._value.get()


@pytest.mark.redis
def test_l2_miss_then_hit_across_processes(env, redis_tier, tmp_path):
    tier, prefix, metrics, client = redis_tier
    store, *_ = env
    record = store.get_task("alpha")
    first = make_cache(env, l2=tier, metrics=metrics, prefix=prefix)
    a1 = first.get(record)
    assert counter(metrics, "l2", "miss") == 1 and counter(metrics, "l3", "hit") == 1
    key = first.key(record)
    assert client.exists(key) and 0 < client.ttl(key) <= 60
    second = make_cache(env, l2=tier, metrics=metrics, prefix=prefix)  # a fresh L1, e.g. another replica
    a2 = second.get(record)
    assert counter(metrics, "l2", "hit") == 1 and counter(metrics, "l3", "hit") == 1
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a1.layers, a2.layers, strict=True))


@pytest.mark.redis
def test_weights_only_adapters_for_the_native_engine(env, redis_tier):
    """routing_layers=False: a routed task's adapter is its routing weights (the same the
    materialising cache computes), a few KB; it goes to L2 under its own key, so a materialising
    replica on the same Redis never reads it as its adapter, nor the other way round."""
    tier, prefix, metrics, client = redis_tier
    store, *_ = env
    record = store.get_task("alpha")
    full = make_cache(env, l2=tier, metrics=metrics, prefix=prefix)
    slim = make_cache(env, l2=tier, metrics=metrics, prefix=prefix, routing_layers=False)
    a_full, a_slim = full.get(record), slim.get(record)
    assert slim.key(record) == full.key(record) + ":w" and client.exists(slim.key(record))
    assert a_slim.layers == [] and torch.equal(a_slim.weights, a_full.weights)
    assert a_slim.nbytes * 50 < a_full.nbytes
    assert counter(metrics, "l2", "hit") == 0 and counter(metrics, "l3", "hit") == 2  # neither read the other's entry
    again = make_cache(env, l2=tier, metrics=metrics, prefix=prefix, routing_layers=False).get(record)
    assert counter(metrics, "l2", "hit") == 1 and again.layers == [] and torch.equal(again.weights, a_full.weights)
    from safetensors.torch import save

    with pytest.raises(ValueError, match="routing weights missing"):  # a weights-only entry without weights
        codec.decode(save({}), "k", "alpha", "routing", env[2], torch.device("cpu"),
                     torch.float32, layers=False)


@pytest.mark.redis
def test_new_routing_version_is_a_new_key(env, redis_tier, tmp_path):
    tier, prefix, metrics, client = redis_tier
    store = build_store(tmp_path / "s", tasks=("omega",))
    bb = tiny_backbone()
    info, skills = store.load_inventory(bb.fingerprint)
    cache = AdapterCache(store, info, skills, fingerprint=bb.fingerprint, device=torch.device("cpu"),
                         dtype=torch.float32, l1=L1Cache(1 << 30), l2=tier, prefix=prefix, metrics=metrics)
    old = store.get_task("omega")
    a_old = cache.get(old)
    put_task(store, "omega", seed=99)
    new = store.get_task("omega")
    assert new.cache_version != old.cache_version and cache.key(new) != cache.key(old)
    a_new = cache.get(new)
    assert a_new is not a_old and not torch.equal(a_new.layers[0][0], a_old.layers[0][0])
    assert client.exists(cache.key(old)) and client.exists(cache.key(new))
    assert counter(metrics, "l2", "hit") == 0 and counter(metrics, "l3", "hit") == 2


@pytest.mark.redis
def test_dead_redis_fails_open_and_opens_the_breaker(env):
    store, *_ = env
    metrics = Metrics()
    breaker = CircuitBreaker(threshold=2, cooldown=60.0)
    tier = RedisTier("redis://127.0.0.1:1/0", ttl_seconds=60, socket_timeout=0.05, connect_timeout=0.05,
                     breaker=breaker, metrics=metrics)
    cache = make_cache(env, l2=tier, metrics=metrics, capacity=0)  # L1 too small: every get goes to L2
    for task in ("alpha", "beta", "gamma", "delta"):
        assert cache.get(store.get_task(task)).layers  # served from L3
    assert breaker.state == "open"
    errors = metrics.redis_errors._value.get()
    assert errors >= 2
    cache.get(store.get_task("alpha"))
    assert metrics.redis_errors._value.get() == errors  # breaker open: no more timeouts paid


@pytest.mark.redis
@pytest.mark.parametrize("garbage", [b"", b"not safetensors at all", b"\xff" * 64, "truncate", "nan"])
def test_undecodable_l2_entry_is_a_counted_miss_and_is_replaced(env, redis_tier, garbage):
    """Whatever sits under the key (garbage, a truncated file, NaNs), the task is served from L3,
    the entry is counted as corrupt, and Redis ends up holding a good copy."""
    tier, prefix, metrics, client = redis_tier
    store, _, info, _ = env
    record = store.get_task("alpha")
    cache = make_cache(env, l2=tier, metrics=metrics, prefix=prefix)
    key = cache.key(record)
    good = codec.encode(cache.materialize(record))
    if garbage == "truncate":
        garbage = good[: len(good) // 2]
    elif garbage == "nan":
        adapter = cache.materialize(record)
        adapter.layers[0][0][0, 0] = float("nan")
        garbage = codec.encode(adapter)
    client.set(key, garbage)
    adapter = cache.get(record)
    assert counter(metrics, "l2", "corrupt") == 1 and counter(metrics, "l2", "hit") == 0
    fresh = cache.materialize(record)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(adapter.layers, fresh.layers, strict=True))
    back = codec.decode(client.get(key), key, "alpha", "routing", info, torch.device("cpu"), torch.float32)
    assert torch.equal(back.layers[0][0], fresh.layers[0][0])  # overwritten with a decodable copy


def weights_only_entry(env, corruption: str) -> bytes:
    """A weights-only L2 entry (what the native engine reads for a routed task), made corrupt."""
    store, *_ = env
    adapter = make_cache(env, routing_layers=False).materialize(store.get_task("alpha"))
    weights = adapter.weights.clone()
    if corruption == "nan":
        weights[0, 0, 0] = float("nan")
    elif corruption == "inf":
        weights[-1, -1, -1] = float("inf")
    elif corruption == "transposed":  # (L, S, h): same numel, wrong shape
        weights = weights.transpose(1, 2).contiguous()
    elif corruption == "one-layer-short":
        weights = weights[:-1].contiguous()
    elif corruption == "flat":
        weights = weights.flatten()
    elif corruption == "extra-tensor":
        from safetensors.torch import save

        return save({"weights": weights, "0.A": torch.zeros(2, 2)})
    return codec.encode(Adapter("alpha", adapter.key, "routing", [], weights))


WEIGHTS_CORRUPTIONS = ["nan", "inf", "transposed", "one-layer-short", "flat", "extra-tensor"]


@pytest.mark.parametrize("corruption", WEIGHTS_CORRUPTIONS)
def test_codec_rejects_a_corrupt_weights_only_entry(env, corruption):
    """The shape and finiteness checks hold for routing weights, not only for materialised tables."""
    info = env[2]
    assert codec.decode(weights_only_entry(env, "none"), "k", "alpha", "routing", info,
                        torch.device("cpu"), torch.float32, layers=False).weights is not None
    with pytest.raises(ValueError, match="cached adapter 'k'"):
        codec.decode(weights_only_entry(env, corruption), "k", "alpha", "routing", info,
                     torch.device("cpu"), torch.float32, layers=False)


@pytest.mark.redis
@pytest.mark.parametrize("corruption", WEIGHTS_CORRUPTIONS)
def test_corrupt_weights_only_l2_entry_is_a_counted_miss_and_is_replaced(env, redis_tier, corruption):
    """The native engine's L2 entry (routing weights only): a NaN or mis-shaped one is never served;
    the task comes from L3 and Redis ends up holding a good copy."""
    tier, prefix, metrics, client = redis_tier
    store, _, info, _ = env
    record = store.get_task("alpha")
    cache = make_cache(env, l2=tier, metrics=metrics, prefix=prefix, routing_layers=False)
    key = cache.key(record)
    client.set(key, weights_only_entry(env, corruption))
    adapter = cache.get(record)
    assert counter(metrics, "l2", "corrupt") == 1 and counter(metrics, "l2", "hit") == 0
    fresh = cache.materialize(record)
    assert torch.equal(adapter.weights, fresh.weights) and bool(torch.isfinite(adapter.weights).all())
    back = codec.decode(client.get(key), key, "alpha", "routing", info, torch.device("cpu"), torch.float32,
                        layers=False)
    assert torch.equal(back.weights, fresh.weights)  # overwritten with a decodable copy


def materialised_entry(env, layer: int, change: str) -> bytes:
    """A materialised adapter's L2 entry with one layer's A or B missing or mis-shaped."""
    from safetensors.torch import save

    store, *_ = env
    adapter = make_cache(env).materialize(store.get_task("alpha"))
    tensors = {f"{i}.{s}": t for i, (a, b) in enumerate(adapter.layers) for s, t in (("A", a), ("B", b))}
    tensors["weights"] = adapter.weights
    side, what = change.split("-")
    name = f"{layer}.{side}"
    if what == "missing":
        del tensors[name]
    else:
        tensors[name] = tensors[name].t().contiguous() if what == "transposed" else tensors[name][:, :-1].contiguous()
    return save(tensors)


@pytest.mark.parametrize("change", ["A-missing", "B-missing", "A-transposed", "B-transposed", "A-narrow", "B-narrow"])
def test_codec_names_the_missing_or_mis_shaped_layer(env, change):
    """Each of A and B is checked on its own (present, and of its own shape), in any layer."""
    info = env[2]
    last = len(info.layer_dims) - 1
    with pytest.raises(ValueError, match=f"cached adapter 'k': layer {last} missing or mis-shaped"):
        codec.decode(materialised_entry(env, last, change), "k", "alpha", "routing", info,
                     torch.device("cpu"), torch.float32)


def test_codec_decodes_into_the_asked_dtype_and_names_what_it_cannot_read(env):
    store, _, info, _ = env
    adapter = make_cache(env).materialize(store.get_task("alpha"))
    back = codec.decode(codec.encode(adapter), "k", "alpha", "routing", info, torch.device("cpu"), torch.float64)
    assert all(a.dtype == torch.float64 and b.dtype == torch.float64 for a, b in back.layers)
    torch.testing.assert_close(back.layers[0][0], adapter.layers[0][0].double())
    with pytest.raises(ValueError, match=r"cached adapter 'k': not a safetensors file \(SafetensorError\)"):
        codec.decode(b"not safetensors at all", "k", "alpha", "routing", info, torch.device("cpu"), torch.float32)


def test_decoded_adapter_carries_the_callers_names_and_an_entry_describes_itself(env):
    """decode returns the task, key and kind it was asked for (a plain-LoRA entry has no routing
    weights); an entry's safetensors header names its key, task and kind for whoever inspects Redis."""
    import json as _json
    import struct

    store, _, info, _ = env
    adapter = make_cache(env).materialize(store.get_task("beta"))
    plain = Adapter("beta", "key-lora", "lora", adapter.layers, None)
    data = codec.encode(plain)
    back = codec.decode(data, "key-lora", "beta", "lora", info, torch.device("cpu"), torch.float32)
    assert (back.task, back.key, back.kind, back.weights) == ("beta", "key-lora", "lora", None)
    routed = codec.decode(codec.encode(adapter), "key-r", "beta", "routing", info, torch.device("cpu"), torch.float32)
    assert (routed.task, routed.key, routed.kind) == ("beta", "key-r", "routing")
    (size,) = struct.unpack("<Q", data[:8])
    header = _json.loads(data[8 : 8 + size])
    assert header["__metadata__"] == {"key": "key-lora", "task": "beta", "kind": "lora"}
