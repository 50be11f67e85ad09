"""Two tenants on the native engine, stepped by hand, latency counted in engine steps (so the
test does not depend on the machine's speed): tenant `flood` keeps long n=4 requests queued as
from many connections, tenant `small` sends one short request at a time. Every small request is
answered without error, and its worst latency stays within 4x its latency on an idle engine
with fair admission; first come, first served leaves it far behind the flood. The engine does
no less work per step under fair admission (generated tokens per step, the throughput figure that
does not depend on the machine)."""

from __future__ import annotations

import pytest

from adapters_store.backbone.tiny import tiny_llama, tiny_tokenizer
from server.engines.fair import TenantCaps
from server.engines.native.config import EngineConfig
from server.engines.native.core.engine import NativeEngine
from server.engines.request import FinalEvent, GenRequest, SamplingParams
from server.infra.metrics import Metrics

# 14 rows: n=4 requests fill 12, the 2 left over are where `small` starts at once under fair
# admission (the flood's cap is 12); first come, first served leaves them to the flood's next
# request, which never fits
ROWS, TENANT_ROWS, FLOOD_CONNECTIONS, SMALL_REQUESTS = 14, 12, 6, 5
FLOOD = SamplingParams(max_new_tokens=48, n=4, ignore_eos=True)
SMALL = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0), tiny_tokenizer()


def engine(model, caps: TenantCaps) -> NativeEngine:
    m, tok = model
    config = EngineConfig(max_batch_rows=ROWS, max_batch_tokens=4096, max_step_tokens=64, caps=caps)
    return NativeEngine(m, tok, None, config, metrics=Metrics())


def tokens_per_step(eng: NativeEngine) -> float:
    family = next(f for f in eng.metrics.registry.collect() if f.name == "polyserve_generation_tokens")
    return sum(s.value for s in family.samples if s.name.endswith("_total")) / eng.steps


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
    fair_engine = engine(model, TenantCaps(weights=weights, max_rows=TENANT_ROWS))
    fcfs_engine = engine(model, TenantCaps(weights=weights, fair=False))
    fair = small_latencies(fair_engine, flood=True)
    fcfs = small_latencies(fcfs_engine, flood=True)
    print(f"small latency in steps: idle {idle}, fair {fair}, fcfs {fcfs}; generated tokens per step: "
          f"fair {tokens_per_step(fair_engine):.2f}, fcfs {tokens_per_step(fcfs_engine):.2f}")
    assert max(fair) <= 4 * idle, (idle, fair)
    assert max(fcfs) > 4 * idle, (idle, fcfs)  # what fair admission fixes
    assert tokens_per_step(fair_engine) >= 0.95 * tokens_per_step(fcfs_engine)
