"""Two tenants on the native engine, stepped by hand, latency counted in engine steps (so the
test does not depend on the machine's speed): tenant `flood` keeps long n=4 requests queued as
from many connections, tenant `small` sends one short request at a time. Every small request is
answered without error, and its worst latency stays within 4x its latency on an idle engine
with fair admission; first come, first served leaves it far behind the flood."""

from __future__ import annotations

import pytest

from adapters_store.tiny import tiny_llama, tiny_tokenizer
from server.engines.fair import TenantCaps
from server.engines.native.engine import NativeEngine
from server.engines.request import FinalEvent, GenRequest, SamplingParams

ROWS, FLOOD_CONNECTIONS, SMALL_REQUESTS = 12, 6, 5
FLOOD = SamplingParams(max_new_tokens=48, n=4, ignore_eos=True)
SMALL = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0), tiny_tokenizer()


def engine(model, caps: TenantCaps) -> NativeEngine:
    m, tok = model
    return NativeEngine(m, tok, max_batch_rows=ROWS, max_batch_tokens=4096, max_step_tokens=64, caps=caps)


def small_latencies(eng: NativeEngine, *, flood: bool) -> list[int]:
    """Steps from submit to the final event of each small request, one after the other, while
    (flood) FLOOD_CONNECTIONS connections of `flood` each resubmit as soon as theirs is answered."""
    latencies = []
    conns: list[GenRequest | None] = [None] * (FLOOD_CONNECTIONS if flood else 0)
    served = 0
    for i in range(SMALL_REQUESTS):
        small = eng.submit(GenRequest([5, 6, 7, 8 + i], SMALL, tenant="small"))
        steps = 0
        while not small.handle.done:
            for c, r in enumerate(conns):
                if r is None or r.handle.done:
                    served += r is not None
                    conns[c] = eng.submit(GenRequest([9] * 20, FLOOD, tenant="flood"))
            eng.step()
            steps += 1
            assert steps < 10_000
        final = [e for e in small.handle.events if isinstance(e, FinalEvent)]
        assert len(final) == 1 and final[0].error is None and final[0].completion_tokens == SMALL.max_new_tokens
        latencies.append(steps)
    assert served or not flood or eng.running, "the flood never ran"
    return latencies


def test_a_flooding_tenant_leaves_a_small_tenant_within_4x_its_idle_latency(model):
    weights = {"flood": 1.0, "small": 1.0}
    idle = max(small_latencies(engine(model, TenantCaps(weights=weights)), flood=False))
    fair = small_latencies(engine(model, TenantCaps(weights=weights, max_rows=ROWS - 4)), flood=True)
    fcfs = small_latencies(engine(model, TenantCaps(weights=weights, fair=False)), flood=True)
    assert max(fair) <= 4 * idle, (idle, fair)
    assert max(fcfs) > 4 * idle, (idle, fcfs)  # what fair admission fixes
