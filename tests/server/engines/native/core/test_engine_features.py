"""Every SamplingParams field on the native engine (tiny model, driven directly): n choices,
logprobs, prompt logprobs, penalties, logit_bias, tiny temperatures; checked against plain
Hugging Face forwards / `generate` with reference processors, and against solo runs."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from server.engines.native.config import EngineConfig
from server.engines.native.core.engine import NativeEngine
from server.engines.request import GenRequest, SamplingParams
from tests.support.engine_utils import choices, run, submit, wait_all

GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)
LOOPING = "abc"  # the tiny model answers it greedily with a two-token loop


@pytest.fixture
def engine(tiny_base, tokenizer, one_thread):
    eng = NativeEngine(tiny_base, tokenizer)
    eng.start()
    yield eng
    eng.stop()


def ids_of(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False).input_ids)


class ReferencePenalties(LogitsProcessor):
    """OpenAI's presence/frequency penalties and logit_bias, token by token (the documented formulas)."""

    def __init__(self, prompt_len: int, presence: float = 0.0, frequency: float = 0.0, bias=()) -> None:
        self.prompt_len, self.presence, self.frequency, self.bias = prompt_len, presence, frequency, bias

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for token, b in self.bias:
            scores[0, token] += b
        generated = input_ids[0, self.prompt_len :].tolist()
        for token in set(generated):
            scores[0, token] -= self.frequency * generated.count(token) + self.presence
        return scores


def hf_greedy(model, ids: list[int], steps: int, **kwargs) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                         pad_token_id=256, **kwargs)
    return out[0, len(ids):].tolist()


def plain_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of one plain forward (no cache, no padding): row j predicts token j + 1."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


# -- n --------------------------------------------------------------------------------------------
def test_n_greedy_choices_are_equal_and_equal_one_choice(engine, tokenizer):
    params = dataclasses.replace(GREEDY, logprobs=0)
    one = run(engine, tokenizer, "hello world", params)
    three = run(engine, tokenizer, "hello world", dataclasses.replace(params, n=3))
    assert [c.final.index for c in three] == [0, 1, 2]
    assert [c.key for c in three] == [one[0].key] * 3
    assert len(one[0].tokens) == 16


def test_n_seeded_choices_are_reproducible_distinct_and_use_seed_plus_index(engine, tokenizer):
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7, ignore_eos=True, logprobs=0, n=3)
    first = run(engine, tokenizer, "seeded", params)
    again = run(engine, tokenizer, "seeded", params)
    assert [c.key for c in first] == [c.key for c in again]
    assert len({tuple(c.tokens) for c in first}) == 3
    for i, choice in enumerate(first):
        alone = run(engine, tokenizer, "seeded", dataclasses.replace(params, n=1, seed=7 + i))
        assert alone[0].key == choice.key


@pytest.mark.parametrize("fields", [
    {"temperature": 1.0, "seed": 21},
    {"temperature": 0.0},
], ids=["seeded", "greedy"])
def test_n_choices_with_penalties_equal_their_solo_runs(engine, tokenizer, fields):
    """Each choice counts only its own tokens. The tiny model's logits are near-uniform, so a
    penalty alone pushes every seen token below the unseen ones whatever the count; logit_bias
    makes a few tokens strongly preferred, so the frequency penalty's count decides when the
    output leaves them: counts shared by the two choices (doubled) change the tokens."""
    params = SamplingParams(max_new_tokens=48, ignore_eos=True, logprobs=0, n=2, frequency_penalty=1.5,
                            logit_bias=((70, 6.0), (71, 5.0), (72, 4.0)), **fields)
    both = run(engine, tokenizer, "penalised", params)
    for i, choice in enumerate(both):
        seed = None if params.seed is None else params.seed + i
        alone = run(engine, tokenizer, "penalised", dataclasses.replace(params, n=1, seed=seed))[0]
        assert choice.key == alone.key, f"choice {i} differs from its solo run"
        assert len(set(choice.tokens)) > 3  # the penalty made it leave the biased tokens
        assert sum(t in (70, 71, 72) for t in choice.tokens) > 3  # after repeating them


def spy_forwards(engine) -> list:
    """Record every step batch the engine's runner runs."""
    seen = []
    forward = engine.runner.forward

    def spy(batch):
        seen.append(batch)
        return forward(batch)

    engine.runner.forward = spy
    return seen


def test_n_choices_share_one_prefill_row(engine, tokenizer):
    seen = spy_forwards(engine)
    out = run(engine, tokenizer, "fork me", dataclasses.replace(GREEDY, n=4))
    prompt = [it for batch in seen for it in batch.items if it.start == 0]
    assert len(prompt) == 1 and len(prompt[0].tokens) == len(ids_of(tokenizer, "fork me"))
    assert max(len(batch.items) for batch in seen) == 4  # then four rows decode
    assert len({c.text for c in out}) == 1


def test_cancel_ends_every_choice(engine, tokenizer):
    req = submit(engine, tokenizer, "long", SamplingParams(max_new_tokens=400, ignore_eos=True, n=3))
    while not req.handle.events:
        time.sleep(0.001)
    req.handle.cancel()
    out = wait_all([req], 5)[0]
    assert [c.final.finish_reason for c in out] == ["cancelled"] * 3
    assert all(c.final.completion_tokens < 400 for c in out)
    for _ in range(100):
        if engine.running == 0:
            break
        time.sleep(0.01)
    assert engine.running == 0


def test_cancel_during_prefill_stops_the_prefill_at_the_next_step(tiny_base, tokenizer, one_thread):
    """A request cancelled while its prompt is still prefilling (8 tokens a step, 300 to go) runs
    no further chunk, sends no token, and every choice gets one cancelled final. Stepped by hand:
    the engine thread never runs, so which step sees the cancel is fixed."""
    eng = NativeEngine(tiny_base, tokenizer, None, EngineConfig(max_batch_rows=4, max_step_tokens=8))
    seen = spy_forwards(eng)
    prompt = [(7 * i) % 250 + 3 for i in range(300)]
    req = eng.submit(GenRequest(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True, n=2)))
    for _ in range(3):
        eng.step()
    assert len(seen) == 3 and eng.prefills and eng.prefills[0].done == 24  # still prefilling
    req.handle.cancel()
    for _ in range(40):  # far more steps than one: nothing of the request may run again
        eng.step()
    assert len(seen) == 3 and eng.steps == 3
    assert not eng.prefills and not eng.rows and eng.running == 0
    assert eng.pool.used == 0  # its two slots are free
    out = choices(req)
    assert [c.final.finish_reason for c in out] == ["cancelled"] * 2
    assert [c.final.completion_tokens for c in out] == [0, 0] and all(not c.events for c in out)
    after = run_by_hand(eng, tokenizer, "next", SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert after.final.finish_reason == "length" and after.final.completion_tokens == 4  # the engine goes on


def run_by_hand(eng, tok, prompt: str, params: SamplingParams):
    req = eng.submit(GenRequest(ids_of(tok, prompt), params))
    for _ in range(100):
        if req.handle.done:
            break
        eng.step()
    return choices(req)[0]


def test_admission_counts_every_choice_as_a_row(tiny_base, tokenizer, one_thread):
    eng = NativeEngine(tiny_base, tokenizer, None, EngineConfig(max_batch_rows=4))
    seen = []
    forward = eng.runner.forward

    def spy(batch):
        seen.append(eng.running)
        return forward(batch)

    eng.runner.forward = spy
    with pytest.raises(ValueError, match="n: 5 choices"):
        submit(eng, tokenizer, "x", dataclasses.replace(GREEDY, n=5))
    reqs = [submit(eng, tokenizer, p, dataclasses.replace(GREEDY, n=3)) for p in ("one", "two")]
    eng.start()
    try:
        out = wait_all(reqs)
    finally:
        eng.stop()
    assert max(seen) == 3  # two requests of 3 rows never share a 4-row batch
    assert all(c.final.completion_tokens == 16 for r in out for c in r)


# -- logprobs ---------------------------------------------------------------------------------------
def test_logprobs_report_every_token_once_with_the_raw_log_softmax(engine, tokenizer, tiny_base):
    ids = ids_of(tokenizer, "hello world")
    out = run(engine, tokenizer, ids, dataclasses.replace(GREEDY, logprobs=3))[0]
    assert len(out.logprobs) == out.final.completion_tokens == 16
    assert out.tokens == hf_greedy(tiny_base, ids, 16)
    ref = plain_logprobs(tiny_base, ids + out.tokens)
    for j, lp in enumerate(out.logprobs):
        row = ref[len(ids) - 1 + j]
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy: the top-1 is the chosen token
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
        assert lp.top[0][1] == pytest.approx(lp.logprob)
    for event in out.events:  # each event's newest token is the last one it reports
        assert event.logprobs and event.logprobs[-1].token_id == event.token_id
    assert out.text == tokenizer.decode(out.tokens, skip_special_tokens=True)


def test_eos_token_is_counted_and_reported(engine, tokenizer):
    eos = 258
    out = run(engine, tokenizer, "stop now", SamplingParams(max_new_tokens=8, logprobs=1, logit_bias=((eos, 100.0),)))
    final = out[0].final
    assert final.finish_reason == "stop" and final.completion_tokens == 1 and out[0].text == ""
    assert out[0].tokens == [eos]
    assert final.logprobs is not None and [lp.token_id for lp in final.logprobs] == [eos]


@pytest.mark.parametrize("step_tokens", [256, 7], ids=["one-chunk", "chunked"])
def test_prompt_logprobs_equal_a_plain_forward(tiny_base, tokenizer, one_thread, step_tokens):
    ids = ids_of(tokenizer, "the quick brown fox")
    engine = NativeEngine(tiny_base, tokenizer, None, EngineConfig(max_step_tokens=step_tokens, max_batch_rows=4))
    seen = spy_forwards(engine)
    asking = dataclasses.replace(GREEDY, max_new_tokens=4, prompt_logprobs=2, n=2)
    reqs = [submit(engine, tokenizer, ids, asking), submit(engine, tokenizer, "other", GREEDY)]
    engine.start()
    try:
        out = wait_all(reqs)
    finally:
        engine.stop()
    ref = plain_logprobs(tiny_base, ids)
    for choice in out[0]:
        plp = choice.final.prompt_logprobs
        assert plp is not None and len(plp) == len(ids) and plp[0] is None
        for i in range(1, len(ids)):
            entry = plp[i]
            assert entry.token_id == ids[i]
            assert entry.logprob == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-4)
            assert [t for t, _ in entry.top] == ref[i - 1].topk(2).indices.tolist()
    assert out[1][0].final.prompt_logprobs is None
    # logits of every prompt position of the asking request only (the other: its last position)
    prompt_items = [(it, batch.logit_rows[j]) for batch in seen for j, it in enumerate(batch.items)
                    if it.logits != "last" or len(it.tokens) > 1]
    asked = sum(r.stop - r.start for it, r in prompt_items if it.logits == "all")
    assert asked == len(ids)
    assert len([it for it, _ in prompt_items if it.logits == "all"]) == (1 if step_tokens > len(ids) else 3)


# -- penalties and bias --------------------------------------------------------------------------
@pytest.mark.parametrize("fields,changes", [
    ({"presence_penalty": 1.0}, True), ({"frequency_penalty": 0.8}, True),
    ({"presence_penalty": -0.5, "frequency_penalty": 0.6}, False),  # negative: may keep the loop
])
def test_presence_and_frequency_penalties_equal_the_openai_formula(engine, tokenizer, tiny_base, fields, changes):
    ids = ids_of(tokenizer, LOOPING)
    plain = run(engine, tokenizer, ids, dataclasses.replace(GREEDY, logprobs=0))[0]
    assert len(set(plain.tokens)) <= 3  # the greedy answer is a loop
    out = run(engine, tokenizer, ids, dataclasses.replace(GREEDY, logprobs=0, **fields))[0]
    ref = ReferencePenalties(len(ids), fields.get("presence_penalty", 0.0), fields.get("frequency_penalty", 0.0))
    assert out.tokens == hf_greedy(tiny_base, ids, 16, logits_processor=LogitsProcessorList([ref]))
    if changes:
        assert out.tokens != plain.tokens


def test_repetition_penalty_equals_hugging_face(engine, tokenizer, tiny_base):
    ids = ids_of(tokenizer, LOOPING)
    plain = run(engine, tokenizer, ids, dataclasses.replace(GREEDY, logprobs=0))[0]
    out = run(engine, tokenizer, ids, dataclasses.replace(GREEDY, logprobs=0, repetition_penalty=1.5))[0]
    assert out.tokens != plain.tokens
    assert out.tokens == hf_greedy(tiny_base, ids, 16, repetition_penalty=1.5)
    both = run(engine, tokenizer, ids, dataclasses.replace(GREEDY, logprobs=0, repetition_penalty=1.3,
                                                           presence_penalty=0.4, frequency_penalty=0.3))[0]
    ref = ReferencePenalties(len(ids), 0.4, 0.3)  # HF applies its repetition penalty first, like us
    assert both.tokens == hf_greedy(tiny_base, ids, 16, repetition_penalty=1.3,
                                    logits_processor=LogitsProcessorList([ref]))


def test_logit_bias_forces_and_forbids_tokens(engine, tokenizer, tiny_base):
    ids = ids_of(tokenizer, "hello world")
    token = ids_of(tokenizer, "z")[0]
    out = run(engine, tokenizer, ids, dataclasses.replace(GREEDY, logprobs=0, logit_bias=((token, 100.0),)))[0]
    assert out.tokens == [token] * 16 and out.text == "z" * 16
    sampled = run(engine, tokenizer, ids, SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, ignore_eos=True,
                                                         logit_bias=((token, 100.0),)))[0]
    assert sampled.text == "z" * 8
    plain = run(engine, tokenizer, ids, dataclasses.replace(GREEDY, logprobs=0))[0]
    ban = ((plain.tokens[0], -100.0),)
    out = run(engine, tokenizer, ids, dataclasses.replace(GREEDY, logprobs=0, logit_bias=ban))[0]
    assert out.tokens[0] != plain.tokens[0]
    ref = ReferencePenalties(len(ids), bias=ban)
    assert out.tokens == hf_greedy(tiny_base, ids, 16, logits_processor=LogitsProcessorList([ref]))
    with pytest.raises(ValueError, match="logit_bias"):
        submit(engine, tokenizer, ids, dataclasses.replace(GREEDY, logit_bias=((engine.vocab_size, 1.0),)))


# -- safe math ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields", [
    {"temperature": 1e-38}, {"temperature": 1e-30}, {"temperature": 1e-6, "top_p": 1e-9},
    {"temperature": 1.0, "top_p": 1e-9}, {"temperature": 1.0, "top_k": 1},
    {"temperature": 1e-5, "seed": 1},  # the smallest sampled temperature: (l - max) / T cannot overflow
])
def test_degenerate_sampling_is_greedy_not_an_error(engine, tokenizer, fields):
    greedy = run(engine, tokenizer, "hello world", dataclasses.replace(GREEDY, logprobs=0))[0]
    out = run(engine, tokenizer, "hello world", dataclasses.replace(GREEDY, logprobs=0, **fields))[0]
    assert out.final.error is None
    assert out.key == greedy.key


@pytest.mark.parametrize("fields", [
    {"temperature": 1e-5, "logit_bias": ((65, 100.0), (66, -100.0))},
    {"temperature": 2.0, "repetition_penalty": 1e-38},
    {"temperature": 0.0, "repetition_penalty": 1e-38, "frequency_penalty": 2.0, "presence_penalty": -2.0},
    {"temperature": 1e-38, "logit_bias": ((65, 100.0),), "top_p": 1e-30},
])
def test_extreme_parameters_never_fail_a_row_or_its_neighbours(engine, tokenizer, fields):
    neighbours = [f"neighbour {i}" for i in range(6)]
    solo = [run(engine, tokenizer, p, GREEDY)[0].key for p in neighbours]
    reqs = [submit(engine, tokenizer, p, GREEDY) for p in neighbours[:3]]
    reqs.append(submit(engine, tokenizer, "extreme", dataclasses.replace(GREEDY, seed=0, **fields)))
    reqs += [submit(engine, tokenizer, p, GREEDY) for p in neighbours[3:]]
    out = wait_all(reqs)
    assert out[3][0].final.error is None and out[3][0].final.completion_tokens == 16
    assert [o[0].key for i, o in enumerate(out) if i != 3] == solo


# -- everything together ---------------------------------------------------------------------------
MIXED = [
    ("plain greedy", GREEDY),
    ("penalised", dataclasses.replace(GREEDY, presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.2)),
    ("biased", dataclasses.replace(GREEDY, logit_bias=((70, 4.0), (71, -3.0)))),
    ("with logprobs", dataclasses.replace(GREEDY, logprobs=2)),
    ("sampled", SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, top_k=40, seed=11, ignore_eos=True)),
    ("two choices", SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, ignore_eos=True, n=2, logprobs=1)),
    ("prompt logprobs", dataclasses.replace(GREEDY, prompt_logprobs=1, frequency_penalty=0.5)),
    ("abc", dataclasses.replace(GREEDY, presence_penalty=1.0)),
    ("short", SamplingParams(max_new_tokens=3, ignore_eos=True)),
]


def test_mixed_batch_equals_solo_runs(tiny_base, tokenizer, one_thread):
    eng = NativeEngine(tiny_base, tokenizer)
    eng.start()
    try:
        solo = [[c.key for c in run(eng, tokenizer, p, params)] for p, params in MIXED]
        eng.stop()
        eng = NativeEngine(tiny_base, tokenizer)  # not started: every request joins one batch
        reqs = [submit(eng, tokenizer, p, params) for p, params in MIXED]
        eng.start()
        together = [[c.key for c in r] for r in wait_all(reqs)]
        staggered_reqs = []
        for p, params in MIXED:  # rows join a running batch
            staggered_reqs.append(submit(eng, tokenizer, p, params))
            time.sleep(0.003)
        staggered = [[c.key for c in r] for r in wait_all(staggered_reqs)]
    finally:
        eng.stop()
    assert together == solo
    assert staggered == solo
    assert len({k[0][0] for k in solo}) == len(MIXED)  # the rows really differ
