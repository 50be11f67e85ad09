"""The native engine's sampling features on the real default backbone (SmolLM2-135M-Instruct:
49k vocabulary, tied embeddings, a real tokenizer): logprobs and prompt logprobs equal a plain
forward, penalties change a greedy answer, a mixed batch equals its solo runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from server.engines.native.core.engine import NativeEngine
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_cached_prefix_gives_the_uncached_answer(default, dtype):
    """The prefix cache on the real serving path (the weight kernel on the GGUF blocks, the
    decode-attention kernel): greedy answers equal with the cache on and off, logprobs close."""
    from server.engines.native.config import EngineConfig

    bb, _ = default
    system = ("You are a helpful assistant for a travel agency. You answer questions about cities, "
              "trains and museums briefly and politely, and you never invent prices or opening hours. ") * 3
    prompts = [system + q for q in ("Where is the Louvre?", "Which city has the Colosseum?",
                                    "How do I get from Paris to Lyon?", "Where is the Louvre?")]
    params = dataclasses.replace(GREEDY, logprobs=0)
    answers = {}
    for budget in (0, 4096):
        engine = NativeEngine(bb.model, bb.tokenizer, config=EngineConfig(dtype=dtype, prefix_cache_tokens=budget))
        engine.start()
        try:
            answers[budget] = [run(engine, bb.tokenizer, p, params)[0] for p in prompts]
        finally:
            engine.stop()
    plain, cached = answers[0], answers[4096]
    assert [c.final.cached_tokens for c in plain] == [0] * 4
    hits = [c.final.cached_tokens for c in cached]
    assert hits[0] == 0 and all(h >= 96 for h in hits[1:]), hits
    for a, b in zip(plain, cached, strict=True):
        assert a.tokens == b.tokens, (a.text, b.text)
        tol = 1e-3 if dtype == torch.float32 else 0.15
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= tol
