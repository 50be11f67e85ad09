"""Fault isolation in the native engine: one bad request fails only itself.

A model wrapper raises (or returns NaN logits) only for rows whose input holds a poison token;
a tokenizer raises for one request; a handle refuses token events; a step or the whole thread
crashes. Every test checks that the other rows' greedy outputs equal their solo runs, that the
bad request gets an error final event per choice, and that nothing hangs (handle.wait(timeout)).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from server.engines.base import EngineStopped
from server.engines.native.config import EngineConfig
from server.engines.native.core import engine as engine_module
from server.engines.native.core.engine import NativeEngine
from server.engines.request import GenRequest, RequestHandle, SamplingParams, TokenEvent
from tests.support.engine_utils import submit, wait_all

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=0)
PROMPTS = ["hello world", "a", "the quick brown fox", "0123456789", "xyz", "polyserve!", "b c"]


class Poisoned:
    """The runner's forward, except: it raises (after running, so the KV slots have already been
    written: the engine must not commit them) if any item of the step holds a token of
    `raise_on`, and returns NaN logits for the items holding a token of `nan_on`.
    `fail(batch, decode)` adds other failures (decode: the step extends rows rather than only
    prefilling prompts)."""

    def __init__(self, engine, raise_on=(), nan_on=(), fail=None) -> None:
        self.forward = engine.runner.forward
        self.raise_on, self.nan_on, self.fail = set(raise_on), set(nan_on), fail
        self.decodes = 0
        engine.runner.forward = self

    def __call__(self, batch):
        decode = any(it.start > 0 and len(it.tokens) == 1 for it in batch.items)
        self.decodes += decode
        out = self.forward(batch)  # first, so a failure leaves written KV positions behind
        if set(batch.tokens.tolist()) & self.raise_on:
            raise RuntimeError("poisoned row in the batch")
        if self.fail is not None and self.fail(batch, decode):
            raise RuntimeError("injected failure")
        for j, item in enumerate(batch.items):
            if set(item.tokens) & self.nan_on:
                out[batch.logit_rows[j]] = float("nan")
        return out


@pytest.fixture(scope="module")
def world(tiny_base, tokenizer):
    """Solo greedy outputs of PROMPTS, and three byte tokens none of them reads or writes."""
    eng = NativeEngine(tiny_base, tokenizer)
    eng.start()
    try:
        solo = {p: wait_all([submit(eng, tokenizer, p, GREEDY)])[0][0] for p in PROMPTS}
    finally:
        eng.stop()
    used = {t for p in PROMPTS for t in tokenizer(p, add_special_tokens=False).input_ids}
    used |= {t for c in solo.values() for t in c.tokens}
    free = [t for t in range(256) if t not in used]
    return {p: c.key for p, c in solo.items()}, free[:3]


def ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False).input_ids)


def engine_with(model, tokenizer, **config) -> NativeEngine:
    """An engine on `model`, not started (so everything submitted before start joins one batch);
    `config`: EngineConfig fields."""
    return NativeEngine(model, tokenizer, config=EngineConfig(**config))


def run_together(eng, tokenizer, bad: GenRequest, position: int = 3):
    """Submit PROMPTS with `bad` among them, start, wait; returns (good choices, bad choices)."""
    reqs = [submit(eng, tokenizer, p, GREEDY) for p in PROMPTS]
    reqs.insert(position, eng.submit(bad))
    eng.start()
    try:
        out = wait_all(reqs, timeout=20)
    finally:
        eng.stop()
    bad_out = out.pop(position)
    return {p: o[0].key for p, o in zip(PROMPTS, out, strict=True)}, bad_out


def assert_failed(choices, n: int = 1) -> None:
    assert len(choices) == n
    for c in choices:
        assert c.final.error, "the bad request must get an error final event"
        assert c.final.finish_reason == "cancelled"


def test_a_prompt_that_breaks_the_prefill_fails_alone(world, tiny_base, tokenizer, one_thread):
    solo, (poison, _, _) = world
    eng = engine_with(tiny_base, tokenizer)
    Poisoned(eng, raise_on={poison})
    bad = GenRequest(ids(tokenizer, "poisoned") + [poison], dataclasses.replace(GREEDY, n=2))
    good, bad_out = run_together(eng, tokenizer, bad)
    assert good == solo
    assert_failed(bad_out, n=2)
    assert "prefill failed" in bad_out[0].final.error


def test_a_row_that_breaks_the_decode_fails_alone(world, tiny_base, tokenizer, one_thread):
    solo, (poison, _, _) = world
    eng = engine_with(tiny_base, tokenizer)
    Poisoned(eng, raise_on={poison})
    # its prompt is clean; logit_bias makes it generate the poison, which the next decode reads
    bad = GenRequest(ids(tokenizer, "decodes poison"), dataclasses.replace(GREEDY, logit_bias=((poison, 100.0),)))
    good, bad_out = run_together(eng, tokenizer, bad)
    assert good == solo
    assert_failed(bad_out)
    assert bad_out[0].final.completion_tokens == 1 and "forward failed" in bad_out[0].final.error


def test_nan_logits_fail_only_their_row(world, tiny_base, tokenizer, one_thread):
    solo, (_, nan_token, _) = world
    eng = engine_with(tiny_base, tokenizer)
    Poisoned(eng, nan_on={nan_token})
    sampled = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1)
    bad = GenRequest(ids(tokenizer, "nan") + [nan_token], sampled)
    good, bad_out = run_together(eng, tokenizer, bad)
    assert good == solo
    assert_failed(bad_out)
    assert "NaN" in bad_out[0].final.error


def test_a_detokenizer_that_raises_fails_only_its_row(world, tiny_base, tokenizer, one_thread):
    solo, (_, _, cursed) = world

    class CursedTokenizer:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def decode(self, token_ids, **kwargs):
            if cursed in token_ids:
                raise UnicodeError("cannot decode")
            return tokenizer.decode(token_ids, **kwargs)

    eng = engine_with(tiny_base, tokenizer)
    eng.tokenizer = CursedTokenizer()
    bad = GenRequest(ids(tokenizer, "cursed") + [cursed], GREEDY)
    good, bad_out = run_together(eng, tokenizer, bad)
    assert good == solo
    assert_failed(bad_out)
    assert "UnicodeError" in bad_out[0].final.error


def test_a_handle_that_refuses_token_events_fails_only_its_row(world, tiny_base, tokenizer, one_thread):
    solo, _ = world

    class Refusing(RequestHandle):
        def push(self, event):
            if isinstance(event, TokenEvent):
                raise OSError("client buffer broken")
            super().push(event)

    eng = engine_with(tiny_base, tokenizer)
    bad = GenRequest(ids(tokenizer, "refuse"), GREEDY, handle=Refusing(None))
    good, bad_out = run_together(eng, tokenizer, bad)
    assert good == solo
    assert_failed(bad_out)


def test_a_transient_decode_failure_fails_nobody(world, tiny_base, tokenizer, one_thread):
    solo, _ = world
    armed = [True]

    def once(batch, decode):
        if decode and armed[0]:  # the first decode step only
            armed[0] = False
            return True
        return False

    eng = engine_with(tiny_base, tokenizer)
    Poisoned(eng, fail=once)
    reqs = [submit(eng, tokenizer, p, GREEDY) for p in PROMPTS]
    eng.start()
    try:
        out = wait_all(reqs, timeout=20)
    finally:
        eng.stop()
    assert not armed[0]
    assert {p: o[0].key for p, o in zip(PROMPTS, out, strict=True)} == solo


def test_a_failure_that_needs_several_rows_fails_those_rows_and_the_engine_goes_on(world, tiny_base, tokenizer,
                                                                                   one_thread):
    solo, _ = world
    eng = engine_with(tiny_base, tokenizer)
    Poisoned(eng, fail=lambda batch, decode: decode and len(batch.items) > 2)
    reqs = [submit(eng, tokenizer, p, GREEDY) for p in PROMPTS[:4]]
    eng.start()
    try:
        out = wait_all(reqs, timeout=20)
        assert all(o[0].final.error and o[0].final.completion_tokens == 1 for o in out)
        later = wait_all([submit(eng, tokenizer, PROMPTS[0], GREEDY)], timeout=20)[0][0]
    finally:
        eng.stop()
    assert later.key == solo[PROMPTS[0]]


def test_a_crashing_step_fails_the_rows_in_flight_and_serves_the_queue(world, tiny_base, tokenizer, one_thread,
                                                                        monkeypatch):
    """Last resort: a bug outside the isolated parts (here: laying out a step's batch). Rows in
    flight and requests mid-prefill get error finals; the engine serves on."""
    solo, _ = world
    armed = threading.Event()
    build = engine_module.StepBatch.build

    def broken(items, device="cpu"):
        if armed.is_set() and any(it.start > 0 for it in items):  # once rows are decoding
            armed.clear()
            raise RuntimeError("bug while laying out the step")
        return build(items, device)

    monkeypatch.setattr(engine_module.StepBatch, "build", broken)
    # 20 tokens a step: the first step prefills two prompts and part of the third, so the crash
    # (second step) finds rows decoding and a request mid-prefill
    eng = engine_with(tiny_base, tokenizer, max_step_tokens=20, max_batch_rows=8)
    armed.set()
    first = [submit(eng, tokenizer, p, dataclasses.replace(GREEDY, n=2)) for p in PROMPTS[:3]]
    eng.start()
    try:
        failed = wait_all(first, timeout=20)
        served = wait_all([submit(eng, tokenizer, p, GREEDY) for p in PROMPTS], timeout=20)
    finally:
        eng.stop()
    for choices in failed:
        assert_failed(choices, n=2)
    assert [c.final.completion_tokens for c in failed[2]] == [0, 0]  # failed mid-prefill
    assert all(c.final.completion_tokens == 1 for r in failed[:2] for c in r)  # failed while decoding
    assert {p: o[0].key for p, o in zip(PROMPTS, served, strict=True)} == solo
    assert len(eng.ledger) == 0


class Die(BaseException):
    pass


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_thread_answers_everyone_and_refuses_new_work(tiny_base, tokenizer, one_thread):
    eng = engine_with(tiny_base, tokenizer, max_batch_rows=2)
    step = eng.step
    steps = [0]

    def dying():
        steps[0] += 1
        if steps[0] == 3:
            raise Die()
        step()

    eng.step = dying
    long = SamplingParams(max_new_tokens=200, ignore_eos=True, n=2)
    reqs = [submit(eng, tokenizer, p, long) for p in PROMPTS[:4]]  # one runs, three wait
    eng.start()
    out = wait_all(reqs, timeout=20)
    for choices in out:
        assert_failed(choices, n=2)
    assert "unexpectedly" in out[0][0].final.error
    eng._thread.join(5)  # type: ignore[union-attr]
    assert not eng.alive
    with pytest.raises(EngineStopped):
        submit(eng, tokenizer, "late", GREEDY)


def test_stop_answers_running_and_waiting_requests_once_per_choice(tiny_base, tokenizer, one_thread):
    eng = engine_with(tiny_base, tokenizer, max_batch_rows=2)
    long = SamplingParams(max_new_tokens=400, ignore_eos=True, n=2)
    reqs = [submit(eng, tokenizer, p, long) for p in PROMPTS[:4]]
    eng.start()
    while not reqs[0].handle.events:
        time.sleep(0.001)
    eng.stop()
    out = wait_all(reqs, timeout=5)  # choices() asserts exactly one final per choice
    for choices in out:
        assert_failed(choices, n=2)
        assert all("shutting down" in c.final.error for c in choices)
    never_started = engine_with(tiny_base, tokenizer)
    queued = submit(never_started, tokenizer, "queued", long)
    never_started.stop()
    assert_failed(wait_all([queued], timeout=1)[0], n=2)


def test_poisoned_decode_is_isolated_by_bisection_not_row_by_row(world, tiny_base, tokenizer, one_thread):
    """With 16 rows and one culprit, isolating costs O(log n) extra forwards, not n."""
    _, (poison, _, _) = world
    eng = engine_with(tiny_base, tokenizer)
    model = Poisoned(eng, raise_on={poison})
    params = dataclasses.replace(GREEDY, max_new_tokens=2)
    reqs = [submit(eng, tokenizer, f"row {i}", params) for i in range(15)]
    reqs.append(submit(eng, tokenizer, "bad", dataclasses.replace(params, logit_bias=((poison, 100.0),))))
    eng.start()
    try:
        out = wait_all(reqs, timeout=20)
    finally:
        eng.stop()
    assert [bool(o[0].final.error) for o in out] == [False] * 15 + [True]
    # the failed decode + at most 2 * log2(16) probes + the retried decode
    assert model.decodes <= 1 + 8 + 1
