"""Structured outputs (`response_format`): the grammar mask, the sampler's mixed batch, the OpenAI
routes through the official client (task and base, streaming and not), refusals, and the vLLM
engine's mapping."""

from __future__ import annotations

import json
import sys
import types

import httpx
import pytest
import torch

from adapters_store.backbone.tiny import tiny_tokenizer
from server.engines.grammar import check_format
from server.engines.native.sample.grammar_mask import RowGrammar, apply_bitmask
from server.engines.native.sample.sampling import RowSampler, sample_tokens
from server.engines.request import SamplingParams
from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone

openai = pytest.importorskip("openai")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
                   "tag": {"enum": ["red", "green"]}},
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
SPEC = ("json_schema", json.dumps(SCHEMA))


def valid(text: str) -> bool:
    return jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(text))


# -- the mask ----------------------------------------------------------------------------------
def test_apply_bitmask_sets_forbidden_tokens_to_minus_inf():
    logits = torch.zeros(3, 40)
    mask = torch.zeros(3, 1, dtype=torch.int32)  # 32 bits for 40 logits: tokens 32.. are never allowed
    mask[0, 0] = 0b101  # tokens 0 and 2
    mask[1, 0] = -1  # tokens 0..31
    # row 2: nothing allowed -> left as is (its next token is refused by the matcher: "length")
    out = apply_bitmask(logits, mask)
    assert torch.isfinite(out[0]).nonzero()[:, 0].tolist() == [0, 2]
    assert torch.isfinite(out[1]).nonzero()[:, 0].tolist() == list(range(32))
    assert torch.isfinite(out[2]).all()


def test_row_grammar_verdicts():
    tok = tiny_tokenizer()
    eos = tok.eos_token_id
    g = RowGrammar.build(("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                     "required": ["a"], "additionalProperties": False})), tok)
    ids = tok('{"a":12', add_special_tokens=False).input_ids
    assert [g.consume(t, False) for t in ids] == ["go"] * len(ids)
    fork = g.fork()
    assert g.consume(eos, True) == "dead"  # not complete: an end token cannot end it validly
    assert fork.consume(tok("}", add_special_tokens=False).input_ids[0], False) == "done"
    other = RowGrammar.build(("json_object", ""), tok)
    assert other.consume(tok("x", add_special_tokens=False).input_ids[0], False) == "dead"


def test_check_format_names_an_invalid_schema():
    tok = tiny_tokenizer()
    assert check_format(SPEC, tok) is None
    assert check_format(("json_object", ""), tok) is None
    assert "nonsense" in check_format(("json_schema", json.dumps({"type": "nonsense"})), tok)


def test_constrained_rows_share_a_batch_without_changing_the_others():
    """A mixed batch: the unconstrained rows sample exactly what they sample alone; each
    constrained row samples a token its grammar allows."""
    tok = tiny_tokenizer()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 259, generator=gen)
    plain = [RowSampler(), RowSampler(1.0, 0, 1.0, torch.Generator().manual_seed(3))]
    alone = sample_tokens(logits[[0, 2]], plain)
    plain[1].generator = torch.Generator().manual_seed(3)
    rows = [plain[0], RowSampler(grammar=RowGrammar.build(SPEC, tok)), plain[1],
            RowSampler(logprobs=1, grammar=RowGrammar.build(("json_object", ""), tok))]
    mixed = sample_tokens(logits, rows)
    assert [mixed.tokens[0], mixed.tokens[2]] == alone.tokens
    assert tok.decode([mixed.tokens[1]]) == "{" and tok.decode([mixed.tokens[3]]) == "{"
    want = torch.log_softmax(logits[3], -1)[mixed.tokens[3]]  # logprobs of the raw logits, not the masked
    assert mixed.logprobs[3].logprob == pytest.approx(float(want), abs=1e-5)


# -- the routes --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    build_store(root / "store")
    with live_server(settings_for(root, max_new_tokens=64, max_n=4), tiny_backbone()) as srv:
        yield srv


@pytest.fixture(scope="module")
def oc(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


MSGS = [{"role": "user", "content": "give me an answer"}]


@pytest.mark.parametrize("model", ["alpha", "base", "mix:alpha=0.5,beta=0.5"])
def test_json_schema_answers_parse_and_validate(oc, model):
    for temperature in (0.0, 1.0):
        chat = oc.chat.completions.create(model=model, messages=MSGS, max_tokens=48, temperature=temperature,
                                          seed=1, n=2, response_format=FORMAT)
        for choice in chat.choices:
            assert choice.finish_reason == "stop", choice
            assert valid(choice.message.content), choice.message.content
        streamed = oc.chat.completions.create(model=model, messages=MSGS, max_tokens=48, temperature=temperature,
                                              seed=1, response_format=FORMAT, stream=True)
        chunks = list(streamed)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert valid(text), text
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
        if temperature == 0.0:
            assert text == chat.choices[0].message.content
    completion = oc.completions.create(model=model, prompt="Input: x\nOutput:", max_tokens=48, temperature=0,
                                       extra_body={"response_format": FORMAT})
    assert completion.choices[0].finish_reason == "stop" and valid(completion.choices[0].text)


def test_json_object_answers_are_objects(oc):
    for model in ("alpha", "base"):
        chat = oc.chat.completions.create(model=model, messages=MSGS, max_tokens=64, temperature=0,
                                          response_format={"type": "json_object"})
        choice = chat.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # a free object can run past max_tokens: then it is never claimed complete
            assert choice.finish_reason == "length"


def test_cut_short_is_length_never_a_complete_invalid_answer(oc):
    chat = oc.chat.completions.create(model="alpha", messages=MSGS, max_tokens=4, temperature=0,
                                      response_format=FORMAT)
    choice = chat.choices[0]
    assert choice.finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(choice.message.content)


REFUSED = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "no"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "stop": ["}"]}, "stop"),
]


@pytest.mark.parametrize(("extra", "param"), REFUSED, ids=[p for _, p in REFUSED])
def test_bad_formats_are_400_naming_the_field(server, extra, param):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for route, body in (("/v1/chat/completions", {"model": "alpha", "messages": MSGS}),
                            ("/v1/completions", {"model": "base", "prompt": "x"})):
            r = http.post(route, json={**body, **extra, "max_tokens": 4})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param, r.text


# -- the vLLM engine's mapping -----------------------------------------------------------------
def test_vllm_gets_the_format_as_its_structured_outputs(monkeypatch):
    from server.engines.vllm.structured import structured_fields, structured_kwargs

    assert structured_fields(SamplingParams()) == {}
    assert structured_fields(SamplingParams(response_format=("json_object", ""))) == {"json_object": True}
    assert structured_fields(SamplingParams(response_format=SPEC)) == {"json": SCHEMA}

    class Params:
        def __init__(self, **kw):
            self.kw = kw

    fake = types.ModuleType("vllm.sampling_params")
    fake.StructuredOutputsParams = Params  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", fake)
    kwargs = structured_kwargs(SamplingParams(response_format=SPEC))
    assert kwargs["structured_outputs"].kw == {"json": SCHEMA}
    assert structured_kwargs(SamplingParams()) == {}


# -- the engine's verdicts ---------------------------------------------------------------------
@pytest.mark.parametrize(("verdicts", "reason", "tokens"), [
    (["go", "go", "done"], "stop", 3),     # the grammar is complete: "stop", the last token's text kept
    (["go", "dead"], "length", 2),          # it cannot go on validly: "length", never "stop"
    (["go"] * 10, "length", 6),             # max_new_tokens first: "length"
], ids=["done", "dead", "max-tokens"])
def test_engine_ends_a_constrained_row_by_its_grammar(tiny_base, tokenizer, one_thread, monkeypatch,
                                                      verdicts, reason, tokens):
    from server.engines.native.core.engine import NativeEngine
    from server.engines.native.sample import grammar_mask
    from tests.support.engine_utils import run

    script = iter(verdicts)
    monkeypatch.setattr(grammar_mask.RowGrammar, "consume", lambda self, token, eos: next(script))
    engine = NativeEngine(tiny_base, tokenizer)
    engine.start()
    try:
        (choice,) = run(engine, tokenizer, "hello",
                        SamplingParams(max_new_tokens=6, response_format=("json_object", ""), logprobs=0))
    finally:
        engine.stop()
    assert choice.final.finish_reason == reason and choice.final.completion_tokens == tokens
    if reason == "stop":
        assert choice.text == tokenizer.decode(choice.tokens)  # the completing token's text is sent
