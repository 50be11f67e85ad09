"""The prefix cache: the block store on its own, then the engine with and without it.

A cached run must equal an uncached one (greedy tokens identical, logprobs within float noise),
with mixed tasks, n > 1, both dtypes and static decode; a block is found only under the adapter
version, tenant and salt that computed it; the budget holds under eviction.
"""

from __future__ import annotations

import pytest
import torch

from server.engines.native.config import EngineConfig
from server.engines.native.core.engine import NativeEngine
from server.engines.native.core.prefix_cache import BLOCK, FIRST_BLOCKS, PrefixCache, chain, namespace
from server.engines.native.core.slots import SlotKV
from server.engines.native.tuning import Tuning
from server.engines.request import FinalEvent, GenRequest, SamplingParams
from server.infra.metrics import Metrics
from tests.support.engine_utils import wait_all
from tests.support.server_fixtures import TASKS, put_task, routed_engine_parts

NS = namespace("task-key", "default", None)


# -- the block store -----------------------------------------------------------------------------
def kv_with(tokens: int, seed: int = 0, dtype=torch.float32) -> SlotKV:
    kv = SlotKV(2, 3, 2, 4, dtype=dtype, capacity=max(tokens, 16))
    gen = torch.Generator().manual_seed(seed)
    for t in (*kv.k, *kv.v):
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    return kv


def test_a_block_is_named_by_its_namespace_and_every_token_before_it():
    tokens = list(range(3 * BLOCK + 5))
    hashes = chain(NS, tokens)
    assert len(hashes) == 3 and chain(NS, tokens) == hashes
    assert chain(NS, tokens, 2) == hashes[:2] and chain(NS, tokens, hashes=hashes[:1]) == hashes
    assert chain(NS, tokens, 10) == hashes  # never more than the full blocks
    changed = tokens.copy()
    changed[BLOCK + 1] += 1  # a token of block 1: blocks 1 and 2 change, block 0 does not
    assert chain(NS, changed)[0] == hashes[0] and set(chain(NS, changed)[1:]).isdisjoint(hashes)
    for other in (namespace("task-key-2", "default", None), namespace("task-key", "acme", None),
                  namespace("task-key", "default", "salt"), namespace(None, "default", None)):
        assert set(chain(other, tokens)).isdisjoint(hashes)


def test_stored_blocks_load_back_into_another_slot_bit_for_bit():
    kv = kv_with(64)
    cache = PrefixCache.like(kv, budget_tokens=256)
    tokens = list(range(50))
    hashes = chain(NS, tokens)
    assert cache.store(hashes, kv, slot=1) == 3 and len(cache) == 3
    assert cache.store(hashes, kv, slot=1) == 0  # already there
    found = cache.match(hashes, len(tokens))
    assert len(found) == 3
    assert cache.load(found, kv, slot=2) == 3 * BLOCK
    for t in (*kv.k, *kv.v):
        assert torch.equal(t[2, :, : 3 * BLOCK], t[1, :, : 3 * BLOCK])


def test_a_slot_filled_to_its_capacity_stores_and_loads(one_thread):
    kv = kv_with(3 * BLOCK)  # the slot holds exactly the three blocks
    cache = PrefixCache.like(kv, budget_tokens=BLOCK)  # the smallest cache: one block
    tokens = list(range(3 * BLOCK))
    assert cache.store(chain(NS, tokens), kv, slot=0) == 1 and cache.load([], kv, 1) == 0
    big = PrefixCache.like(kv, budget_tokens=1 << 20)
    assert big.store(chain(NS, tokens), kv, slot=0) == 3
    assert big.load(big.match(chain(NS, tokens + [1]), 3 * BLOCK + 1), kv, slot=1) == 3 * BLOCK
    assert torch.equal(kv.k[1][1], kv.k[1][0]) and torch.equal(kv.v[0][1], kv.v[0][0])
    with pytest.raises(ValueError, match="one block of 16 tokens"):
        PrefixCache.like(kv, budget_tokens=BLOCK - 1)


def test_the_storage_grows_by_doubling_only_when_full():
    cache = PrefixCache.like(kv_with(16), budget_tokens=1 << 20)
    one = kv_with(FIRST_BLOCKS * BLOCK)
    cache.store(chain(NS, list(range(FIRST_BLOCKS * BLOCK))), one, slot=0)
    assert cache.data.shape[0] == FIRST_BLOCKS
    cache.store(chain(NS, [7] * BLOCK), one, slot=0)
    assert cache.data.shape[0] == 2 * FIRST_BLOCKS and len(cache) == FIRST_BLOCKS + 1


def test_a_match_leaves_the_prompts_last_token_to_compute():
    kv = kv_with(64)
    cache = PrefixCache.like(kv, budget_tokens=256)
    tokens = list(range(2 * BLOCK))  # exactly two blocks
    cache.store(chain(NS, tokens), kv, slot=0)
    assert len(cache.match(chain(NS, tokens), len(tokens))) == 1
    longer = tokens + [7]
    assert len(cache.match(chain(NS, longer), len(longer))) == 2
    assert cache.match(chain(namespace("other", "default", None), longer), len(longer)) == []


def test_eviction_holds_the_budget_and_drops_the_least_recently_used():
    kv = kv_with(4 * BLOCK)
    cache = PrefixCache.like(kv, budget_tokens=4 * BLOCK)  # four blocks
    prompts = [[p * 1000 + i for i in range(2 * BLOCK + 1)] for p in range(5)]  # two blocks each
    for p in prompts[:2]:
        cache.store(chain(NS, p), kv, slot=0)
    assert len(cache) == 4
    assert len(cache.match(chain(NS, prompts[0]), len(prompts[0]))) == 2  # prompt 0 used: prompt 1 goes first
    cache.store(chain(NS, prompts[2]), kv, slot=0)
    assert len(cache) == 4 and cache.stats.evicted == 2
    assert len(cache.match(chain(NS, prompts[0]), len(prompts[0]))) == 2
    assert cache.match(chain(NS, prompts[1]), len(prompts[1])) == []
    for p in prompts[3:]:
        cache.store(chain(NS, p), kv, slot=0)
        assert len(cache) <= cache.max_blocks
    assert cache.nbytes <= 4 * cache.block_bytes  # the storage never outgrows the budget
    long = list(range(10 * BLOCK))  # longer than the whole cache: its first blocks are kept
    kv_long = kv_with(10 * BLOCK)
    cache.store(chain(NS, long[: 2 * BLOCK]), kv_long, slot=0)  # its start is cached already
    cache.store(chain(NS, long), kv_long, slot=0)
    assert len(cache) == 4 and len(cache.match(chain(NS, long), len(long))) == 4


def test_a_chain_is_evicted_from_its_end():
    kv = kv_with(4 * BLOCK)
    cache = PrefixCache.like(kv, budget_tokens=4 * BLOCK)
    a = list(range(3 * BLOCK + 1))
    cache.store(chain(NS, a), kv, slot=0)
    b = [9999] * (2 * BLOCK + 1)
    cache.store(chain(NS, b), kv, slot=0)  # a's oldest-touched block is its last one
    assert len(cache.match(chain(NS, a), len(a))) == 2


# -- the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return routed_engine_parts(tmp_path_factory.mktemp("store"))


def engine_for(setup, **config) -> NativeEngine:
    bb, rm, _, _ = setup
    engine = NativeEngine(bb.model, bb.tokenizer, rm, EngineConfig(**config), metrics=Metrics())
    engine.start()
    return engine


def prompt(bb, shared: int, own: int, seed: int) -> list[int]:
    """`shared` tokens the same for every seed, then `own` tokens of this seed."""
    gen = torch.Generator().manual_seed(1000 + seed)
    vocab = len(bb.tokenizer)
    head = torch.randint(3, vocab, (shared,), generator=torch.Generator().manual_seed(1)).tolist()
    return head + torch.randint(3, vocab, (own,), generator=gen).tolist()


def serve(engine, jobs, params, together: bool = False) -> list[list]:
    """jobs: (prompt ids, adapter, tenant, salt); the choices of each, submitted one after another
    so that each finds what the ones before it left in the cache (together: all at once, in one
    mixed batch)."""
    reqs = [GenRequest(list(ids), params, adapter, getattr(adapter, "task", "base"), tenant=tenant, cache_salt=salt)
            for ids, adapter, tenant, salt in jobs]
    if together:
        with engine._cond:  # the engine admits nothing until all are queued: the same batches every run
            for r in reqs:
                engine.submit(r)
        return wait_all(reqs, timeout=120)
    return [wait_all([engine.submit(r)], timeout=120)[0] for r in reqs]


def finals(choices) -> list[FinalEvent]:
    return [c.final for c in choices]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("static_decode", ["off", "on"], ids=["dynamic", "static"])
def test_a_cached_run_equals_an_uncached_one(setup, dtype, static_decode, one_thread):
    bb, _, store, cache = setup
    adapters = [cache.get(store.get_task(t)) for t in TASKS] + [None]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=2, n=2, temperature=0.8, seed=5)
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=2)
    # every task twice with a 70-token prefix of its own (a chunked prefill: max_step_tokens 40),
    # one request after another; then every task again with another question, all in one batch
    jobs = [(prompt(bb, 70, 5 + i % 3, seed=i), adapters[i % len(adapters)], "default", None) for i in range(10)]
    jobs += [(prompt(bb, 70, 4, seed=100 + i), adapters[i % len(adapters)], "default", None) for i in range(10)]
    runs = {}
    for budget in (0, 4096):
        engine = engine_for(setup, dtype=dtype, tuning=Tuning(static_decode=static_decode), max_step_tokens=40,
                            max_batch_rows=8, prefix_cache_tokens=budget)
        try:
            runs[budget] = (serve(engine, jobs[:10], greedy) + serve(engine, jobs[10:], greedy, together=True),
                            serve(engine, jobs[:4], params, together=True))
        finally:
            engine.stop()
    (plain, plain_n), (cached, cached_n) = runs[0], runs[4096]
    hits = [finals(c)[0].cached_tokens for c in cached]
    assert all(f.cached_tokens == 0 for c in plain for f in finals(c))
    assert hits[:len(adapters)] == [0] * len(adapters)  # nothing cached yet for a task's first prompt
    assert all(h == 64 for h in hits[10:]), hits  # the shared 70 tokens, in whole blocks
    tol = 1e-4 if dtype == torch.float32 else 0.05
    for a, b in zip(plain + plain_n, cached + cached_n, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.tokens == y.tokens and x.text == y.text
            assert x.final.prompt_tokens == y.final.prompt_tokens
            torch.testing.assert_close(torch.tensor([lp.logprob for lp in x.logprobs]),
                                       torch.tensor([lp.logprob for lp in y.logprobs]), atol=tol, rtol=0)


def test_a_rewritten_task_never_meets_its_old_kv(setup, one_thread):
    """vLLM's stale-adapter bug: the same task name with other weights must not reuse the KV its
    old version computed (a name-only key fails this test)."""
    bb, _, store, cache = setup
    put_task(store, "epsilon", seed=11)
    ids = prompt(bb, 60, 6, seed=3)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=0)
    engine = engine_for(setup, prefix_cache_tokens=4096)
    fresh = engine_for(setup, prefix_cache_tokens=0)
    try:
        old = cache.get(store.get_task("epsilon"))
        first, again = serve(engine, [(ids, old, "default", None)] * 2, params)
        assert (finals(first)[0].cached_tokens, finals(again)[0].cached_tokens) == (0, 64)
        put_task(store, "epsilon", seed=12)  # re-registered: a new version, new weights
        new = cache.get(store.get_task("epsilon"))
        assert new.task == old.task and new.key != old.key
        (after,) = serve(engine, [(ids, new, "default", None)], params)
        assert finals(after)[0].cached_tokens == 0
        (want,) = serve(fresh, [(ids, new, "default", None)], params)
        assert after[0].tokens == want[0].tokens and after[0].tokens != first[0].tokens
        store.delete_task("epsilon")  # deleted and created again under the same name
        put_task(store, "epsilon", seed=13)
        recreated = cache.get(store.get_task("epsilon"))
        (again_new,) = serve(engine, [(ids, recreated, "default", None)], params)
        assert finals(again_new)[0].cached_tokens == 0
    finally:
        engine.stop()
        fresh.stop()


def test_tenants_and_salts_reuse_only_their_own_blocks(setup, one_thread):
    bb, _, store, cache = setup
    alpha = cache.get(store.get_task("alpha"))
    secret = prompt(bb, 64, 3, seed=7)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    engine = engine_for(setup, prefix_cache_tokens=4096)
    try:
        got = serve(engine, [(secret, alpha, "tenant-a", None),   # computes it
                             (secret, alpha, "tenant-b", None),   # another tenant: no hit
                             (secret, alpha, "tenant-a", None),   # its own tenant: a hit
                             (secret, alpha, "tenant-a", "s1"),   # a salt of its own: no hit
                             (secret, alpha, "tenant-a", "s1"),   # the same salt again: a hit
                             (secret, None, "tenant-a", None)],   # the bare model: another key
                    params)
        assert [finals(c)[0].cached_tokens for c in got] == [0, 0, 64, 0, 64, 0]
    finally:
        engine.stop()


def test_the_metrics_and_the_budget(setup, one_thread):
    bb, _, store, cache = setup
    alpha = cache.get(store.get_task("alpha"))
    engine = engine_for(setup, prefix_cache_tokens=6 * BLOCK)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    try:
        jobs = [(prompt(bb, 0, 3 * BLOCK + 1, seed=i), alpha, "default", None) for i in range(4)]
        serve(engine, jobs + jobs[-1:], params)
        assert engine.prefix is not None and len(engine.prefix) == 6
        assert engine.prefix.nbytes <= 6 * engine.prefix.block_bytes
        m = engine.metrics
        assert m.prefix_cache_queries._value.get() == 5 * (3 * BLOCK + 1)
        assert m.prefix_cache_hits._value.get() == 3 * BLOCK  # the repeated last prompt
        text = m.render().decode()
        assert "polyserve_prefix_cache_blocks 6.0" in text
        assert "polyserve_prefix_cache_hit_tokens_total 48.0" in text
    finally:
        engine.stop()


def test_prompt_logprobs_are_computed_for_every_position(setup, one_thread):
    bb = setup[0]
    ids = prompt(bb, 40, 2, seed=9)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True, prompt_logprobs=0)
    engine = engine_for(setup, prefix_cache_tokens=4096)
    try:
        _, second = serve(engine, [(ids, None, "default", None)] * 2, params)
        assert finals(second)[0].cached_tokens == 0
        assert len(finals(second)[0].prompt_logprobs) == len(ids)
        (plain,) = serve(engine, [(ids, None, "default", None)], SamplingParams(max_new_tokens=2, ignore_eos=True))
        assert finals(plain)[0].cached_tokens == 32  # what those requests computed was kept
    finally:
        engine.stop()


def test_the_setting_is_validated():
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        EngineConfig(prefix_cache_tokens=5)
    assert EngineConfig().prefix_cache_budget == EngineConfig().max_batch_tokens
    assert EngineConfig(prefix_cache_tokens=0).prefix_cache_budget == 0


def test_cached_prompt_tokens_take_no_room_in_a_step(setup, one_thread):
    """The scheduler counts only what a prompt still has to compute against a step's room: four
    requests whose 96-token prefix is cached join one step (one would, counted in full)."""
    bb, rm, _, _ = setup
    engine = NativeEngine(bb.model, bb.tokenizer, rm, EngineConfig(max_step_tokens=48, max_batch_rows=8,
                                                                   prefix_cache_tokens=4096))
    ids = prompt(bb, 96, 0, seed=0)
    first = engine.submit(GenRequest([*ids, 5], SamplingParams(max_new_tokens=1)))
    while not first.handle.done:
        engine.step()
    reqs = [engine.submit(GenRequest([*ids, 6 + i], SamplingParams(max_new_tokens=4))) for i in range(4)]
    engine.step()
    assert len(engine.rows) == 4 and [r.cached_tokens for r in reqs] == [96] * 4


def test_the_start_up_log_states_the_budget(setup, caplog):
    bb, rm, _, _ = setup
    with caplog.at_level("INFO", logger="polyserve.engine"):
        NativeEngine(bb.model, bb.tokenizer, rm, EngineConfig(prefix_cache_tokens=100))
        NativeEngine(bb.model, bb.tokenizer, rm, EngineConfig(prefix_cache_tokens=0))
    lines = [r.getMessage() for r in caplog.records if "prefix cache" in r.getMessage()]
    assert lines[0].startswith("prefix cache: up to 96 prompt tokens") and lines[1] == "prefix cache: off"
