"""The native engine's sampling features on the real default backbone (SmolLM2-135M-Instruct:
49k vocabulary, tied embeddings, a real tokenizer): logprobs and prompt logprobs equal a plain
forward, penalties change a greedy answer, a mixed batch equals its solo runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from server.engines.native.engine import NativeEngine
from server.engines.request import SamplingParams
from tests.support.engine_utils import run, submit, wait_all

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=0)
PROMPT = "List the days of the week: Monday, Tuesday,"


@pytest.fixture(scope="module")
def default():
    from adapters_store.backbone.load import load_backbone

    bb = load_backbone("default")
    engine = NativeEngine(bb.model, bb.tokenizer)
    engine.start()
    yield bb, engine
    engine.stop()


def test_logprobs_and_prompt_logprobs_equal_a_plain_forward(default):
    bb, engine = default
    ids = list(bb.tokenizer(PROMPT, add_special_tokens=False).input_ids)
    out = run(engine, bb.tokenizer, ids, dataclasses.replace(GREEDY, logprobs=2, prompt_logprobs=1))[0]
    with torch.inference_mode():
        ref = torch.log_softmax(bb.model(torch.tensor([ids + out.tokens])).logits[0].float(), -1)
    for j, lp in enumerate(out.logprobs):
        assert lp.top[0][0] == lp.token_id
        assert lp.logprob == pytest.approx(float(ref[len(ids) - 1 + j, lp.token_id]), abs=2e-3)
    plp = out.final.prompt_logprobs
    assert plp is not None and plp[0] is None and len(plp) == len(ids)
    for i in range(1, len(ids)):
        assert plp[i].token_id == ids[i]
        assert plp[i].logprob == pytest.approx(float(ref[i - 1, ids[i]]), abs=2e-3)


def test_mixed_features_batch_equals_solo_and_penalties_change_the_answer(default):
    bb, engine = default
    cases = [
        (PROMPT, GREEDY),
        (PROMPT, dataclasses.replace(GREEDY, repetition_penalty=1.5, frequency_penalty=0.5)),
        ("Count: one, two, three,", dataclasses.replace(GREEDY, presence_penalty=2.0, frequency_penalty=2.0)),
        ("Count: one, two, three,", GREEDY),
        ("Write a word:", SamplingParams(max_new_tokens=8, temperature=0.9, seed=3, n=2, ignore_eos=True, logprobs=0)),
    ]
    solo = [[c.key for c in run(engine, bb.tokenizer, p, params)] for p, params in cases]
    together = [[c.key for c in r] for r in wait_all([submit(engine, bb.tokenizer, p, params) for p, params in cases])]
    assert together == solo
    assert solo[1][0][1] != solo[0][0][1] and solo[2][0][1] != solo[3][0][1]
    assert solo[4][0] != solo[4][1]  # two seeded choices differ
