"""The tenants' prompt budget (server/engines/native/core/scheduler.py, plan_step with
tenant_prefill_tokens): while a tenant's rows decode, other tenants' prompt chunks share a small
budget of the step, the shortest first; a tenant's own chunks, and steps with nobody else
decoding, keep the whole max_step_tokens; off, a step is filled in admission order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from adapters_store.backbone.tiny import tiny_llama, tiny_tokenizer
from server.engines.fair import TenantCaps
from server.engines.native.config import EngineConfig
from server.engines.native.core.engine import NativeEngine
from server.engines.native.core.scheduler import Prefill, Scheduler
from server.engines.request import GenRequest, SamplingParams
from server.infra.metrics import Metrics
from server.wiring.settings import Settings
from tests.support.engine_utils import choices

WEIGHTS = {"flood": 1.0, "small": 1.0}


def row(tenant: str, slot: int) -> SimpleNamespace:
    req = GenRequest([1, 2, 3], SamplingParams(max_new_tokens=8), tenant=tenant)
    return SimpleNamespace(slot=slot, length=3, last_token=4, req=req)


def prefill(tenant: str, prompt: int, slot: int) -> Prefill:
    return Prefill(GenRequest(list(range(5, 5 + prompt)), SamplingParams(max_new_tokens=8), tenant=tenant), [slot])


def chunks(scheduler: Scheduler, rows, prefills) -> dict[int, int]:
    """slot -> prompt tokens the planned step gives it."""
    items, owners = scheduler.plan_step(rows, prefills)
    return {owner.slots[0]: len(item.tokens) for item, owner in zip(items, owners, strict=True)
            if isinstance(owner, Prefill)}


def test_other_tenants_chunks_share_the_bound_while_a_tenant_decodes():
    config = EngineConfig(max_batch_rows=8, max_step_tokens=256, tenant_prefill_tokens=32)
    sched = Scheduler(config)
    decoding = [row("flood", 0), row("flood", 1), row("small", 2)]
    # flood's long prompt delays small's decoding row: 32 tokens of the step, not 253
    assert chunks(sched, decoding, [prefill("flood", 500, 5)]) == {5: 32}
    # two tenants' prompts: the short one first, both within the bound
    assert chunks(sched, decoding, [prefill("flood", 500, 5), prefill("small", 6, 6)]) == {6: 6, 5: 26}
    # only flood decodes: its own prompt takes the whole step; small's short one still goes first
    flood_only = [row("flood", 0), row("flood", 1)]
    assert chunks(sched, flood_only, [prefill("flood", 500, 5)]) == {5: 254}
    assert chunks(sched, flood_only, [prefill("flood", 500, 5), prefill("small", 6, 6)]) == {6: 6, 5: 248}
    # nobody decodes: nothing to delay
    assert chunks(sched, [], [prefill("flood", 500, 5), prefill("small", 600, 6)]) == {5: 256}


def test_without_the_bound_a_step_is_filled_in_admission_order():
    sched = Scheduler(EngineConfig(max_batch_rows=8, max_step_tokens=256, tenant_prefill_tokens=0))
    decoding = [row("flood", 0), row("small", 2)]
    assert chunks(sched, decoding, [prefill("flood", 500, 5), prefill("small", 6, 6)]) == {5: 254}


def test_a_bound_below_zero_is_refused_and_fairness_off_has_none():
    with pytest.raises(ValueError, match="tenant_prefill_tokens"):
        EngineConfig(tenant_prefill_tokens=-1)
    on = Settings(tenant_prefill_tokens=24, dtype="float32")
    assert EngineConfig.from_settings(on).tenant_prefill_tokens == 24
    off = Settings(tenant_prefill_tokens=24, tenant_fairness=False, dtype="float32")
    assert EngineConfig.from_settings(off).tenant_prefill_tokens == 0  # the old single FCFS engine


# -- on the engine, stepped by hand --------------------------------------------------------------------
FLOOD = SamplingParams(max_new_tokens=24, n=4, ignore_eos=True)
SMALL = SamplingParams(max_new_tokens=4, ignore_eos=True)


def flood_and_small(bound: int) -> tuple[list[int], list[GenRequest]]:
    """A flood of long-prompt n=4 requests (16 rows), with small 4-token requests one after another:
    the flood's prompt tokens in each step that decodes a small row, and every request."""
    eng = NativeEngine(tiny_llama(seed=0), tiny_tokenizer(), None,
                       EngineConfig(max_batch_rows=16, max_batch_tokens=16384, max_step_tokens=160,
                                    tenant_prefill_tokens=bound, caps=TenantCaps(weights=WEIGHTS)),
                       metrics=Metrics())
    floods = [eng.submit(GenRequest([9, 10, 11 + i] * 60, FLOOD, tenant="flood")) for i in range(12)]
    plan = eng.scheduler.plan_step
    seen: list[int] = []

    def recording(rows, prefills):
        items, owners = plan(rows, prefills)
        if any(r.req.tenant == "small" for r in rows):
            seen.append(sum(len(i.tokens) for i, o in zip(items, owners, strict=True)
                            if isinstance(o, Prefill) and o.req.tenant == "flood"))
        return items, owners

    eng.scheduler.plan_step = recording  # type: ignore[method-assign]
    smalls: list[GenRequest] = []
    for _ in range(600):
        if (not smalls or smalls[-1].handle.done) and len(smalls) < 12:
            smalls.append(eng.submit(GenRequest([5, 6, 7], SMALL, tenant="small")))
        if all(r.handle.done for r in [*floods, *smalls]) and len(smalls) == 12:
            break
        eng.step()
    else:
        raise AssertionError("requests did not finish")
    return seen, [*floods, *smalls]


def test_a_small_tenants_decode_steps_carry_at_most_the_bound_of_the_floods_prompts():
    bounded, reqs = flood_and_small(16)
    assert bounded and max(bounded) <= 16
    for r in reqs:
        assert all(c.final.error is None and c.final.completion_tokens == r.params.max_new_tokens
                   for c in choices(r))
    unbounded, _ = flood_and_small(0)  # the same traffic, no bound: the flood's prompts fill those steps
    assert max(unbounded) > 100


# -- admission: each tenant's prompts have their own room ------------------------------------------------
def test_another_tenants_long_prompt_does_not_hold_a_short_one_out_of_admission():
    """Prompt tokens admitted and not yet forwarded stay under one step's room: under fair
    admission per tenant, so the flood's 500-token prompt (more than a step) does not keep the
    small tenant's next request waiting until it is forwarded; the flood's own next one waits."""
    config = EngineConfig(max_batch_rows=8, max_step_tokens=64, caps=TenantCaps(weights=WEIGHTS))
    sched = Scheduler(config)
    decoding = [row("flood", 0), row("small", 1)]
    pending = [prefill("flood", 500, 2)]
    late_flood = GenRequest(list(range(5, 25)), SamplingParams(max_new_tokens=8), tenant="flood")
    small = GenRequest([5, 6, 7], SamplingParams(max_new_tokens=8), tenant="small")
    assert sched.waiting.push(late_flood) is None and sched.waiting.push(small) is None
    admitted = [p.req for p in sched.admit(decoding, pending).admitted]
    assert admitted == [small]
    # fairness off: one queue, one room, which the flood's prompt fills
    fcfs = Scheduler(EngineConfig(max_batch_rows=8, max_step_tokens=64, caps=TenantCaps(weights=WEIGHTS, fair=False)))
    assert fcfs.waiting.push(GenRequest([5, 6, 7], SamplingParams(max_new_tokens=8), tenant="small")) is None
    assert fcfs.admit(decoding, pending).admitted == []
