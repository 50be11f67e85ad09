"""The continuous-batching engine on the tiny model, driven directly (no HTTP)."""

from __future__ import annotations

import time

import pytest

from server.engines.base import QueueFull
from server.engines.native.config import EngineConfig
from server.engines.native.core.engine import NativeEngine as Engine
from server.engines.native.tuning import Tuning
from server.engines.request import FinalEvent, GenRequest, SamplingParams, TokenEvent
from tests.support.server_fixtures import TASKS, routed_engine_parts

PROMPTS = ["hello world", "a", "the quick brown fox jumps", "0123456789", "xyz", "polyserve!", "mixed tasks", "b c"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    bb, rm, store, cache = routed_engine_parts(tmp_path_factory.mktemp("store"))
    adapters = {t: cache.get(store.get_task(t)) for t in TASKS}
    adapters["base"] = None
    return bb, rm, adapters


def make_engine(setup, **config) -> Engine:
    """A started engine on the setup's backbone; `config`: EngineConfig fields."""
    bb, rm, _ = setup
    engine = Engine(bb.model, bb.tokenizer, rm, EngineConfig(**config))
    engine.start()
    return engine


def run(engine: Engine, tok, jobs: list[tuple[str, str]], adapters, params=None, stagger: float = 0.0):
    reqs = []
    for prompt, task in jobs:
        ids = list(tok(prompt, add_special_tokens=False).input_ids)
        p = params or SamplingParams(max_new_tokens=16, ignore_eos=True)
        reqs.append(engine.submit(GenRequest(ids, p, adapters[task], task)))
        if stagger:
            time.sleep(stagger)
    for r in reqs:
        assert r.handle.wait(30)
    return [("".join(e.text for e in r.handle.events), r.handle.events[-1]) for r in reqs]


def jobs8():
    tasks = [*TASKS, "base"]
    return [(PROMPTS[i], tasks[i % len(tasks)]) for i in range(8)]


@pytest.mark.parametrize("kind,step_tokens,lora_kernel",
                         [("llama", 256, "auto"), ("llama", 12, "auto"), ("llama", 256, "off"), ("hf", 256, "auto"),
                          ("hf", 12, "auto")],
                         ids=["llama", "llama-chunked", "llama-torch-lora", "hf", "hf-chunked"])
def test_mixed_batch_equals_solo_greedy(setup, kind, step_tokens, lora_kernel):
    """Rows of different tasks (and base) in one forward give each row its solo answer, on both
    runners, with the decode rows' LoRA in the native kernel (where it builds) and as torch ops;
    with 12 tokens a step, prompts are prefilled in chunks beside decoding rows."""
    bb, _, adapters = setup
    engine = make_engine(setup, max_step_tokens=step_tokens, max_batch_rows=8,
                         tuning=Tuning(native_executor=kind, lora_kernel=lora_kernel))
    try:
        solo = [run(engine, bb.tokenizer, [job], adapters)[0] for job in jobs8()]
        together = run(engine, bb.tokenizer, jobs8(), adapters)
        staggered = run(engine, bb.tokenizer, jobs8(), adapters, stagger=0.003)  # rows join mid-batch
    finally:
        engine.stop()
    assert [t for t, _ in together] == [t for t, _ in solo]
    assert [t for t, _ in staggered] == [t for t, _ in solo]
    assert len({t for t, _ in solo}) > 4  # tasks really differ
    assert all(f.finish_reason == "length" and f.completion_tokens == 16 for _, f in together)


def step_until_done(engine: Engine, reqs: list[GenRequest]) -> list[str]:
    """Drive a never-started engine by hand: which rows share a step is fixed by the submissions."""
    for _ in range(200):
        if all(r.handle.done for r in reqs):
            break
        engine.step()
    assert all(r.handle.done for r in reqs)
    return ["".join(e.text for e in r.handle.events) for r in reqs]


@pytest.mark.parametrize("kind", ["llama", "hf"])
def test_base_rows_moved_into_finished_tasks_slots_keep_their_solo_answer(setup, kind):
    """Slot compaction moves a base row into a slot a task's row held: alpha (slot 0) finishes
    and gamma moves 3 -> 0, then beta (slot 1) finishes and the base row moves 2 -> 1, where
    beta's tables were. Every row's text equals its solo run. Stepped by hand: no timing."""
    bb, rm, adapters = setup
    tok = bb.tokenizer

    def request(prompt: str, task: str, tokens: int) -> GenRequest:
        ids = list(tok(prompt, add_special_tokens=False).input_ids)
        return GenRequest(ids, SamplingParams(max_new_tokens=tokens, ignore_eos=True), adapters[task], task)

    def alone(job) -> str:
        engine = Engine(bb.model, bb.tokenizer, rm, EngineConfig(max_batch_rows=4, tuning=Tuning(native_executor=kind)))
        return step_until_done(engine, [engine.submit(request(*job))])[0]

    jobs = [("first", "alpha", 2), ("second", "beta", 3), ("the base row", "base", 14), ("last", "gamma", 14)]
    solo = [alone(job) for job in jobs]
    engine = Engine(bb.model, bb.tokenizer, rm, EngineConfig(max_batch_rows=4, tuning=Tuning(native_executor=kind)))
    reqs = [engine.submit(request(*job)) for job in jobs]
    def slots() -> dict[str, int]:
        return {r.req.task: r.slot for r in engine.rows}

    engine.step()
    assert slots() == {"alpha": 0, "beta": 1, "base": 2, "gamma": 3}  # one prefill step
    engine.step()
    assert slots() == {"beta": 1, "base": 2, "gamma": 0}
    engine.step()
    assert slots() == {"base": 1, "gamma": 0}
    assert step_until_done(engine, reqs) == solo
    assert alone(("the base row", "alpha", 14)) != solo[2]  # a task's tables would change its text


def test_adapters_change_the_output(setup):
    bb, _, adapters = setup
    engine = make_engine(setup)
    try:
        outs = run(engine, bb.tokenizer, [("same prompt", t) for t in [*TASKS, "base"]], adapters)
    finally:
        engine.stop()
    assert len({t for t, _ in outs}) == len(TASKS) + 1


def test_seeded_sampling_is_reproducible_and_batch_independent(setup):
    bb, _, adapters = setup
    engine = make_engine(setup)
    p = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=123, ignore_eos=True)
    try:
        alone = run(engine, bb.tokenizer, [("seeded", "alpha")], adapters, p)[0][0]
        mixed = run(engine, bb.tokenizer, [("other", "beta"), ("seeded", "alpha"), ("x", "base")], adapters, p)
        other_seed = run(engine, bb.tokenizer, [("seeded", "alpha")], adapters,
                         SamplingParams(max_new_tokens=12, temperature=0.9, seed=124, ignore_eos=True))[0][0]
    finally:
        engine.stop()
    assert mixed[1][0] == alone
    assert other_seed != alone


def test_stop_string_cuts_text(setup):
    bb, _, adapters = setup
    engine = make_engine(setup)
    try:
        full = run(engine, bb.tokenizer, [("stop me", "gamma")], adapters)[0][0]
        stop = full[5:7]
        cut, final = run(engine, bb.tokenizer, [("stop me", "gamma")], adapters,
                         SamplingParams(max_new_tokens=16, stop=(stop,), ignore_eos=True))[0]
    finally:
        engine.stop()
    assert cut == full[: full.index(stop)]
    assert final.finish_reason == "stop"


def test_cancel_frees_the_row_within_a_step(setup):
    bb, _, adapters = setup
    engine = make_engine(setup)
    try:
        ids = list(bb.tokenizer("long one", add_special_tokens=False).input_ids)
        req = engine.submit(GenRequest(ids, SamplingParams(max_new_tokens=400, ignore_eos=True), adapters["alpha"]))
        while not req.handle.events:
            time.sleep(0.001)
        req.handle.cancel()
        steps = engine.steps
        assert req.handle.wait(5)
        assert engine.steps - steps <= 1
        final = req.handle.events[-1]
        assert isinstance(final, FinalEvent) and final.finish_reason == "cancelled"
        for _ in range(100):
            if engine.running == 0:
                break
            time.sleep(0.01)
        assert engine.running == 0
    finally:
        engine.stop()


def test_queue_full_raises_with_retry_after(setup):
    bb, rm, _ = setup
    engine = Engine(bb.model, bb.tokenizer, rm, EngineConfig(max_queue=2))  # not started: nothing drains
    p = SamplingParams(max_new_tokens=4)
    engine.submit(GenRequest([1, 2], p))
    engine.submit(GenRequest([1, 2], p))
    with pytest.raises(QueueFull) as err:
        engine.submit(GenRequest([1, 2], p))
    assert err.value.retry_after >= 1
    with pytest.raises(ValueError, match="max_batch_tokens"):
        engine.submit(GenRequest([1] * 20000, p))


@pytest.mark.parametrize("prompt", [[1, "2"], [1, 259], [-1], [1.0]], ids=["str", "beyond-vocab", "negative", "float"])
def test_a_prompt_of_bad_token_ids_is_refused_at_submit(setup, prompt):
    """A direct caller's bad token id is a ValueError at submit (-> 4xx), never an item of a shared
    step (where laying the step out would fail every row in flight)."""
    bb, rm, _ = setup
    engine = Engine(bb.model, bb.tokenizer, rm)
    with pytest.raises(ValueError, match="prompt: token id"):
        engine.submit(GenRequest(prompt, SamplingParams(max_new_tokens=4)))


@pytest.mark.parametrize("rows,tokens,expect_rows", [(3, 10_000, 3), (8, 120, 2)], ids=["rows", "tokens"])
def test_row_and_token_budgets_bound_the_batch(setup, rows, tokens, expect_rows):
    """Each of jobs8 costs len(prompt) + 40 = 41..65 KV positions: 3 rows bind in the first case,
    120 tokens (two rows, never three) in the second; the batch fills up to the binding budget."""
    bb, _, adapters = setup
    engine = make_engine(setup, max_batch_rows=rows, max_batch_tokens=tokens)
    seen = []
    orig = engine.runner.forward

    def spy(batch):
        reqs = [r.req for r in engine.rows] + [p.req for p in engine.prefills]
        seen.append((engine.running, sum(r.budget_tokens for r in reqs), len(batch.items)))
        return orig(batch)

    engine.runner.forward = spy
    try:
        out = run(engine, bb.tokenizer, jobs8(), adapters, SamplingParams(max_new_tokens=40, ignore_eos=True))
    finally:
        engine.stop()
    assert max(n for n, _, _ in seen) == expect_rows
    assert max(t for _, t, _ in seen) <= tokens
    assert max(items for _, _, items in seen) == expect_rows
    assert all(f.completion_tokens == 40 for _, f in out)


def test_background_tasks_interleave_with_decoding(setup):
    bb, _, adapters = setup
    engine = make_engine(setup)
    slices: list[tuple[int, int]] = []
    remaining = [30]

    def work() -> bool:
        slices.append((engine.steps, engine.running))
        remaining[0] -= 1
        return remaining[0] > 0

    try:
        ids = list(bb.tokenizer("go", add_special_tokens=False).input_ids)
        req = engine.submit(GenRequest(ids, SamplingParams(max_new_tokens=20, ignore_eos=True), adapters["beta"]))
        engine.add_background_task(work)
        assert req.handle.wait(10)
        for _ in range(200):
            if remaining[0] == 0:
                break
            time.sleep(0.01)
    finally:
        engine.stop()
    assert remaining[0] == 0
    busy = [s for s, running in slices if running]
    assert busy  # slices did run while the request was decoding
    assert len(busy) == len(set(busy))  # at most one slice per decode step while rows are running


def test_token_events_concatenate_to_the_final_text(setup):
    """Streaming: the events' texts concatenate to the decoded answer, each TokenEvent names the
    newest token, and asking for logprobs changes nothing but adds every token's entry."""
    bb, _, adapters = setup
    engine = make_engine(setup)
    tok = bb.tokenizer
    ids = list(tok("stream ✓ é", add_special_tokens=False).input_ids)
    plain_p = SamplingParams(max_new_tokens=24, ignore_eos=True)
    try:
        plain = engine.submit(GenRequest(ids, plain_p, adapters["delta"]))
        traced = engine.submit(GenRequest(ids, SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=0),
                                          adapters["delta"]))
        assert plain.handle.wait(10) and traced.handle.wait(10)
    finally:
        engine.stop()
    events = traced.handle.events
    assert all(isinstance(e, TokenEvent) for e in events[:-1]) and isinstance(events[-1], FinalEvent)
    gen_ids = [lp.token_id for e in events for lp in (e.logprobs or [])]
    assert len(gen_ids) == events[-1].completion_tokens == 24
    assert "".join(e.text for e in events) == tok.decode(gen_ids, skip_special_tokens=True)
    for e in events[:-1]:
        assert e.logprobs and e.token_id == e.logprobs[-1].token_id
    assert len(events[0].logprobs) == 1  # the first token is sent at once (time to first token)
    plain_events = plain.handle.events
    assert [(e.text, e.token_id) for e in plain_events[:-1]] == [(e.text, e.token_id) for e in events[:-1]]
    assert plain_events[-1].text == events[-1].text and plain_events[-1].logprobs is None
