"""Rows are lent and taken back (server/engines/native/core/scheduler.py), on the native engine stepped
by hand: a tenant alone fills every row, even with requests of n=4 and a row count that is not a
multiple of 4 (split admission); a tenant that comes back gets a row at the next step (preemption);
a preempted row, recomputed, generates exactly what it would have; under a flood, fair admission
generates as many tokens per step as first come, first served (a static row cap does not)."""

from __future__ import annotations

import pytest

from adapters_store.backbone.tiny import tiny_llama, tiny_tokenizer
from server.engines.fair import TenantCaps
from server.engines.native.config import EngineConfig
from server.engines.native.core.engine import NativeEngine
from server.engines.request import GenRequest, SamplingParams
from server.infra.metrics import Metrics
from tests.support.engine_utils import choices

WEIGHTS = {"flood": 1.0, "small": 1.0}
FLOOD = SamplingParams(max_new_tokens=40, n=4, ignore_eos=True, logprobs=0)
SMALL = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0), tiny_tokenizer()


def engine(model, rows: int, caps: TenantCaps | None = None) -> NativeEngine:
    m, tok = model
    return NativeEngine(m, tok, None, EngineConfig(max_batch_rows=rows, max_batch_tokens=8192, max_step_tokens=64,
                                                   caps=caps or TenantCaps(weights=WEIGHTS)), metrics=Metrics())


def flood(i: int, params: SamplingParams = FLOOD) -> GenRequest:
    return GenRequest([9, 10, 11 + i] * 6, params, tenant="flood")


def run_until_done(eng: NativeEngine, reqs: list[GenRequest], limit: int = 2000) -> None:
    for _ in range(limit):
        if all(r.handle.done for r in reqs):
            return
        eng.step()
    raise AssertionError("requests did not finish")


def test_one_tenant_alone_fills_every_row_even_when_n_does_not_divide_them(model):
    """14 rows, n=4 requests: whole requests fill 12; the fourth request starts split in the last
    2 rows (its other 2 choices wait for slots) instead of leaving them idle."""
    eng = engine(model, rows=14)
    reqs = [eng.submit(flood(i)) for i in range(5)]
    for _ in range(3):
        eng.step()
        assert eng.pool.used == 14, eng.pool.used
    run_until_done(eng, reqs)
    for r in reqs:
        assert all(c.final.error is None and c.final.completion_tokens == 40 for c in choices(r))


def test_a_tenant_that_comes_back_gets_a_row_at_the_next_step(model):
    """flood holds all 8 rows; small's request takes one back (preemption) at once, where it
    would otherwise wait for a flood request to end (40 steps)."""
    eng = engine(model, rows=8)
    floods = [eng.submit(flood(i)) for i in range(4)]
    for _ in range(5):
        eng.step()
    assert eng.pool.used == 8 and {r.req.tenant for r in eng.rows} == {"flood"}
    small = eng.submit(GenRequest([5, 6, 7], SMALL, tenant="small"))
    eng.step()
    assert any(r.req is small for r in eng.rows), "small has no row after one step"
    assert len(eng.scheduler.preempted) == 1 and eng.pool.used == 8
    run_until_done(eng, [small, *floods])
    assert [c.final.error for c in choices(small)] == [None]


def test_a_preempted_row_whose_client_left_is_answered_at_the_next_step(model):
    eng = engine(model, rows=4)
    big = eng.submit(flood(0))
    for _ in range(3):
        eng.step()
    small = eng.submit(GenRequest([5, 6, 7], SMALL, tenant="small"))
    eng.step()
    assert len(eng.scheduler.preempted) == 1
    big.handle.cancelled.set()
    eng.step()
    assert not eng.scheduler.preempted and all(c.final is not None for c in choices(big))
    run_until_done(eng, [small])


@pytest.mark.parametrize("params", [FLOOD, SamplingParams(max_new_tokens=40, n=4, temperature=1.0, seed=7,
                                                          ignore_eos=True, logprobs=0)], ids=["greedy", "seeded"])
def test_a_preempted_row_generates_what_it_would_have(model, params):
    """Each flood request alone, then the same requests while small tenants' requests keep
    preempting flood rows: every choice's tokens and text are the same."""
    alone = []
    for i in range(2):
        eng = engine(model, rows=8)
        req = eng.submit(flood(i, params))
        run_until_done(eng, [req])
        alone.append([c.key for c in choices(req)])
    eng = engine(model, rows=8)
    floods = [eng.submit(flood(i, params)) for i in range(2)]
    preempted = 0
    for k in range(6):
        for _ in range(3):
            eng.step()
        small = eng.submit(GenRequest([5, 6, 7 + k], SMALL, tenant="small"))
        eng.step()
        preempted += len(eng.scheduler.preempted)
        run_until_done(eng, [small])
    run_until_done(eng, floods)
    assert preempted >= 3, "the small requests never preempted a flood row"
    assert [[c.key for c in choices(r)] for r in floods] == alone


def test_fairness_off_and_a_single_tenant_never_preempt_or_split(model):
    """First come, first served, and fair admission with one tenant, admit as before: whole
    requests only (12 of 14 rows with n=4), nothing preempted."""
    for caps in (TenantCaps(weights=WEIGHTS, fair=False), TenantCaps()):
        eng = engine(model, rows=14, caps=caps)
        reqs = [eng.submit(GenRequest([9] * 10, FLOOD, tenant="default")) for _ in range(5)]
        eng.step()
        assert eng.pool.used == 12 and not eng.scheduler.preempted
        run_until_done(eng, reqs)


def generated_per_step(eng: NativeEngine) -> float:
    family = next(f for f in eng.metrics.registry.collect() if f.name == "polyserve_generation_tokens")
    return sum(s.value for s in family.samples if s.name.endswith("_total")) / eng.steps


def flood_mix(eng: NativeEngine, steps: int = 400) -> list[int]:
    """The two-tenant benchmark's mix, scaled: `flood` keeps 10 connections of n=4 requests busy,
    `small` sends one 4-token request after another (one idle step between two). Returns small's
    latencies in steps."""
    conns: list[GenRequest | None] = [None] * 10
    small, gap, started, latencies = None, 0, 0, []
    for s in range(steps):
        for c, r in enumerate(conns):
            if r is None or r.handle.done:
                conns[c] = eng.submit(GenRequest([9] * 20, SamplingParams(max_new_tokens=64, n=4, ignore_eos=True),
                                                 tenant="flood"))
        if small is not None and small.handle.done:
            assert [c.final.error for c in choices(small)] == [None]
            latencies.append(s - started)
            small, gap = None, 1
        if small is None and (gap := gap - 1) < 0:
            small, started = eng.submit(GenRequest([5, 6, 7], SMALL, tenant="small")), s
        eng.step()
    return latencies


def test_under_a_flood_fair_admission_does_as_much_work_per_step_as_fcfs(model):
    """16 rows: fair admission (rows lent, taken back by preemption) generates >= 0.95 x the
    tokens per step of first come, first served, and small's latency stays within 4x idle; a
    static row cap that keeps rows for small (12 of 16, n=4) does not reach 0.95."""
    idle = engine(model, rows=16)
    small = idle.submit(GenRequest([5, 6, 7], SMALL, tenant="small"))
    run_until_done(idle, [small])
    idle_steps = idle.steps
    fair, fcfs = engine(model, rows=16), engine(model, rows=16, caps=TenantCaps(weights=WEIGHTS, fair=False))
    capped = engine(model, rows=16, caps=TenantCaps(weights=WEIGHTS, max_rows=12, preempt=False))
    fair_lat, fcfs_lat = flood_mix(fair), flood_mix(fcfs)
    flood_mix(capped)
    per_step = {name: generated_per_step(e) for name, e in (("fair", fair), ("fcfs", fcfs), ("capped", capped))}
    print(f"generated tokens per step {per_step}; small latency in steps: idle {idle_steps}, "
          f"fair max {max(fair_lat)} ({len(fair_lat)} requests), fcfs max {max(fcfs_lat, default=None)}")
    assert per_step["fair"] >= 0.95 * per_step["fcfs"], per_step
    assert per_step["capped"] < 0.95 * per_step["fcfs"], per_step  # what lending fixes
    assert max(fair_lat) <= 4 * idle_steps, (idle_steps, fair_lat)


def test_a_row_just_used_stays_free_for_its_tenant_a_few_passes_then_is_lent_again(model):
    """small's row, once its request ends, is held `hold_passes` passes: small's next request
    takes it without preempting anyone; if small stays away, flood gets the row back."""
    eng = engine(model, rows=8, caps=TenantCaps(weights=WEIGHTS, hold_passes=4))
    floods = [eng.submit(flood(i)) for i in range(4)]
    eng.step()
    small = eng.submit(GenRequest([5, 6, 7], SMALL, tenant="small"))
    run_until_done(eng, [small])
    assert len(eng.scheduler.preempted) == 1  # the flood row small took
    eng.step()
    assert eng.pool.used == 7 and len(eng.scheduler.preempted) == 1  # held for small, not resumed
    again = eng.submit(GenRequest([5, 6, 8], SMALL, tenant="small"))
    eng.step()
    assert any(r.req is again for r in eng.rows) and len(eng.scheduler.preempted) == 1  # no second preemption
    run_until_done(eng, [again])
    for _ in range(6):
        eng.step()
    assert eng.pool.used == 8 and not eng.scheduler.preempted  # small away: the row is lent again
    run_until_done(eng, floods)
