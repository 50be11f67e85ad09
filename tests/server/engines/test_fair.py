"""The fair admission queue (server/engines/fair.py), stepped by hand: which request one pass
admits given free rows and KV tokens, the counters after each step, and the per-tenant caps."""

from __future__ import annotations

import pytest

from server.engines.fair import (
    FairQueue,
    InFlight,
    Lent,
    TenantCaps,
    TenantLimit,
    check_caps,
    check_submit_caps,
    reclaim,
)
from server.engines.request import GenRequest, SamplingParams

_clock = iter(range(1, 10**9))


def req(tenant: str, prompt: int = 10, n: int = 1, max_new: int = 10) -> GenRequest:
    r = GenRequest([1] * prompt, SamplingParams(max_new_tokens=max_new, n=n), tenant=tenant)
    r.arrival = float(next(_clock))  # a strict arrival order, whatever the clock's resolution
    return r


def queue(caps: TenantCaps | None = None, max_queue: int = 100, rows: int = 8, tokens: int = 10_000) -> FairQueue:
    return FairQueue(caps or TenantCaps(weights={"a": 1.0, "b": 1.0}), max_queue=max_queue, max_rows=rows,
                     max_tokens=tokens)


def admit_all(q: FairQueue, free_rows: int, free_tokens: int, use: dict | None = None) -> list[GenRequest]:
    p = q.begin(use or {})
    out = []
    while (r := p.next(free_rows, free_tokens)) is not None:
        out.append(r)
        free_rows -= r.params.n
        free_tokens -= r.budget_tokens
    return out


def test_the_least_served_tenant_goes_first():
    q = queue()
    a1, a2, b1 = req("a"), req("a"), req("b")
    for r in (a1, a2, b1):
        assert q.push(r) is None
    q.charge("a", 100)  # a has had 100 tokens of service, b none
    assert admit_all(q, 1, 10_000) == [b1]
    # b's prompt (10) is charged at admission: a (100) is still ahead of b (10) in service
    assert q.counter("b") == 10 and q.counter("a") == 100
    assert admit_all(q, 2, 10_000) == [a1, a2]


def test_service_counts_prompt_and_generated_tokens_over_the_weight():
    q = queue(TenantCaps(weights={"a": 2.0, "b": 1.0}))
    a, b = req("a", prompt=40), req("b", prompt=40)
    q.push(a)
    q.push(b)
    assert admit_all(q, 2, 10_000) == [a, b]  # tie: the older head first
    assert q.counter("a") == 20 and q.counter("b") == 40
    q.charge("a", 10)
    q.charge("b", 10)
    assert q.counter("a") == 25 and q.counter("b") == 50


def test_an_idle_tenant_banks_no_credit():
    """b was away while a got 1000 tokens of service: when b comes back its counter is lifted to
    a's, so it shares from now on instead of taking the engine until it has caught up."""
    q = queue()
    a1 = req("a")
    q.push(a1)
    assert admit_all(q, 8, 10_000) == [a1]
    q.charge("a", 1000)
    q.begin({"a": InFlight(1, 20)})  # a is active (in flight); b has nothing anywhere
    b1 = req("b")
    q.push(b1)
    assert q.counter("b") == q.counter("a") == 1010


def test_a_request_that_does_not_fit_never_blocks_another_tenants_request():
    """a's head needs 4 rows, 2 are free: b's 1-row request behind it is admitted now."""
    q = queue()
    a_big, b_small = req("a", n=4), req("b")
    q.push(a_big)
    q.push(b_small)
    q.charge("b", 5)  # b has had more: a is first in line, and blocked
    assert admit_all(q, 2, 10_000) == [b_small]
    assert len(q) == 1


def test_a_head_that_waited_patience_passes_reserves_its_room():
    """a needs 4 rows, 1 free each pass: b's 1-row requests fit around it (never blocked) until a
    has waited `patience` passes; then a reserves its 4 rows and b's next one waits for room.
    Without lending only: lending, a would start split in the free row (the scheduler's part)."""
    q = queue(TenantCaps(weights={"a": 1.0, "b": 1.0}, patience=2, preempt=False))
    a_big = req("a", n=4)
    q.push(a_big)
    b_reqs = [req("b") for _ in range(4)]
    for r in b_reqs:
        q.push(r)
    q.charge("b", 100)  # b has had more: a is first in line every pass
    assert admit_all(q, 1, 10_000) == [b_reqs[0]]  # pass 1: a skipped once
    assert admit_all(q, 1, 10_000) == [b_reqs[1]]  # pass 2: twice
    assert admit_all(q, 1, 10_000) == []  # pass 3: a reserves 4 rows; b's 1 no longer fits in 1 - 4
    assert admit_all(q, 5, 10_000) == [a_big, b_reqs[2]]
    assert admit_all(q, 1, 10_000) == [b_reqs[3]]


def test_within_one_tenant_the_order_is_first_come_first_served():
    q = queue()
    big, small = req("a", n=4), req("a")
    q.push(big)
    q.push(small)
    assert admit_all(q, 2, 10_000) == []  # the small one does not overtake its own tenant's head


def test_fairness_off_is_one_fifo_queue_with_head_of_line_blocking():
    q = queue(TenantCaps(weights={"a": 1.0, "b": 1.0}, fair=False))
    a_big, b_small = req("a", n=4), req("b")
    q.push(a_big)
    q.push(b_small)
    q.charge("b", 0)
    assert admit_all(q, 2, 10_000) == []
    assert admit_all(q, 5, 10_000) == [a_big, b_small]


def test_rows_and_kv_caps_make_a_tenant_wait_without_reserving():
    caps = TenantCaps(weights={"a": 1.0, "b": 1.0}, max_rows=4, kv_share=0.5)
    q = queue(caps, rows=8, tokens=1000)
    a1, a2, b1 = req("a", n=4), req("a", n=1), req("b", n=1)
    for r in (a1, a2, b1):
        q.push(r)
    assert admit_all(q, 8, 1000) == [a1, b1]  # a2 would put a at 5 rows: it waits, b goes
    q.push(a3 := req("a", prompt=100, max_new=300))  # a holds 0 now; 400 tokens <= 500
    assert admit_all(q, 8, 1000, {"a": InFlight(0, 200)}) == [a2]
    # a2 (20 tokens) was admitted: a holds 220, a3 (400) would exceed its 500: it waits
    assert admit_all(q, 8, 1000, {"a": InFlight(1, 220)}) == []
    assert admit_all(q, 8, 1000, {"a": InFlight(0, 0)}) == [a3]


def test_a_request_that_alone_exceeds_its_tenants_caps_is_refused_for_good():
    caps = TenantCaps(max_rows=2, kv_share=0.1)
    with pytest.raises(TenantLimit) as err:
        check_caps(req("a", n=3), caps, max_rows=8, max_tokens=1000)
    assert err.value.limit == "rows" and err.value.permanent
    with pytest.raises(TenantLimit) as err:
        check_caps(req("a", prompt=60, max_new=60), caps, max_rows=8, max_tokens=1000)
    assert err.value.limit == "kv_share" and err.value.permanent
    check_caps(req("a", n=3), TenantCaps(max_rows=2, fair=False), max_rows=8, max_tokens=1000)


def test_one_tenants_flood_fills_only_its_own_share_of_the_queue():
    """The waiting queue is shared by weight: a's flood is refused at its share (naming its own
    limit) while b still queues. Without tenants the engine's one queue is the limit, as before."""
    q = queue(TenantCaps(weights={"a": 3.0, "b": 1.0}), max_queue=8)
    assert [q.push(req("a")) for _ in range(7)] == [None] * 6 + ["queued"]
    assert [q.push(req("b")) for _ in range(3)] == [None, None, "queued"]
    capped = queue(TenantCaps(weights={"a": 1.0, "b": 1.0}, max_queued=2), max_queue=8)
    assert [capped.push(req("a")) for _ in range(3)] == [None, None, "queued"]
    one = queue(TenantCaps(), max_queue=2)
    assert [one.push(req("default")) for _ in range(3)] == [None, None, "queue"]


def test_cancelled_heads_are_dropped_not_admitted():
    q = queue()
    a1, a2 = req("a"), req("a")
    q.push(a1)
    q.push(a2)
    a1.handle.cancel()
    p = q.begin({})
    assert p.next(8, 10_000) is a2 and p.cancelled == [a1]


def test_drain_returns_every_waiting_request_oldest_first():
    q = queue()
    rs = [req("a"), req("b"), req("a")]
    for r in rs:
        q.push(r)
    assert q.drain() == rs and len(q) == 0


def test_submit_caps_for_an_engine_that_schedules_itself():
    """vLLM: a tenant's requests in the engine count against its caps before the next one enters."""
    caps = TenantCaps(weights={"a": 1.0, "b": 1.0}, max_rows=3, kv_share=0.5)
    held = [req("a", n=2), req("b", n=3)]
    kw = {"max_queue": 8, "max_rows": 8, "max_tokens": 1000, "retry_after": 2}
    check_submit_caps(req("a"), caps, held, **kw)
    with pytest.raises(TenantLimit) as err:
        check_submit_caps(req("a", n=2), caps, held, **kw)
    assert err.value.limit == "rows" and not err.value.permanent and err.value.retry_after == 2
    with pytest.raises(TenantLimit) as err:
        check_submit_caps(req("b", prompt=250, max_new=200, n=1), TenantCaps(kv_share=0.5), held, **kw)
    assert err.value.limit == "kv_share"
    check_submit_caps(req("b", n=3), TenantCaps(fair=False, max_rows=1), held, **kw)


def test_reclaim_takes_the_cheapest_rows_from_tenants_above_their_share_only():
    """a holds all 8 rows (share 4 each): b may take rows back, cheapest first, never taking a
    below its share; a tenant that would pass its own share takes nothing."""
    rows = [Lent("a", cost, 20, object()) for cost in (50, 10, 30, 40, 20, 60, 70, 80)]
    use = {"a": InFlight(8, 160), "b": InFlight(0, 0)}
    shares = {"a": 4.0, "b": 4.0}
    assert [v.cost for v in reclaim("b", 2, 0, rows, use, shares) or []] == [10, 20]
    assert reclaim("b", 5, 0, rows, use, shares) is None  # b would hold 5 > its share of 4
    assert reclaim("a", 1, 0, rows, use, shares) is None  # nobody else is above its share
    use["c"] = InFlight(0, 0)
    assert reclaim("c", 4, 0, rows, use, {"a": 2.0, "b": 3.0, "c": 3.0}) is None  # c would hold 4 > its share of 3
    assert [v.cost for v in reclaim("c", 3, 0, rows, use, {"a": 2.0, "b": 3.0, "c": 3.0}) or []] == [10, 20, 30]
    assert reclaim("b", 1, 0, rows, {"a": InFlight(4, 80), "b": InFlight(0, 0)}, shares) is None  # a at its share
