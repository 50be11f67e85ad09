"""What clients written for vLLM send, against a live server (tiny backbone, random inventory):
vLLM's sampling extensions, batch prompts, scoring a prompt without generating (its logprobs
against a plain forward of the task's adapter), /tokenize, /detokenize, /version; plus the pure
pieces underneath (min-p, the min_tokens mask, stop tokens, the detokenizer's options)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from server.engines.native.sample.detok import IncrementalDetokenizer
from server.engines.native.sample.processors import RowProcessors, apply_processors
from server.engines.native.sample.rows import stop_token
from server.engines.native.sample.sampling import apply_min_p
from server.engines.request import SamplingParams
from tests.support.server_fixtures import (
    SPEC,
    build_store,
    live_server,
    random_skills,
    settings_for,
    tiny_backbone,
)

EOS = 258  # the tiny tokenizer's <|im_end|>


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-compat")
    build_store(root / "store")
    settings = settings_for(root, warmup=False, dtype="float32", max_prompt_tokens=64, max_new_tokens=64, max_n=4,
                            max_prompts_per_request=5)
    with live_server(settings, tiny_backbone()) as srv:
        yield srv


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def z(server) -> int:
    return server.runtime.tokenizer("Z", add_special_tokens=False).input_ids[0]


def sse(text: str) -> list:
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
            for line in text.splitlines() if line.startswith("data: ")]


def complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={"model": "alpha", "prompt": "hello", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


# -- pure pieces ----------------------------------------------------------------------------------
def test_min_p_keeps_tokens_within_the_ratio_of_the_top():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    scaled = probs.log() - probs.log().max()
    kept = torch.isfinite(apply_min_p(scaled, 0.5)).tolist()
    assert kept == [True, True, False, False]  # 0.3 >= 0.25, 0.15 < 0.25
    assert torch.equal(apply_min_p(scaled, 0.0), scaled)


def test_min_tokens_masks_stop_ids_until_reached():
    params = SamplingParams(max_new_tokens=8, min_tokens=2, stop_token_ids=(5,))
    procs = RowProcessors.build(params, [1, 2], vocab_size=10, eos_ids=frozenset({9}))
    assert procs is not None
    logits = torch.zeros(1, 10)
    for _ in range(2):
        out = apply_processors(logits, [procs])
        assert torch.isinf(out[0, [5, 9]]).all() and torch.isfinite(out[0, :5]).all()
        procs.observe(3)
    assert torch.isfinite(apply_processors(logits, [procs])).all()
    ignoring = RowProcessors.build(SamplingParams(max_new_tokens=8, min_tokens=2, ignore_eos=True), [1], 10,
                                   eos_ids=frozenset({9}))
    assert ignoring is None  # with ignore_eos and no stop ids there is nothing to mask
    assert RowProcessors.build(SamplingParams(max_new_tokens=8, min_tokens=0), [1], 10, eos_ids=frozenset({9})) is None


def test_stop_token_rules():
    eos = frozenset({9})
    assert stop_token(SamplingParams(), 9, 1, eos)
    assert not stop_token(SamplingParams(ignore_eos=True), 9, 1, eos)
    assert stop_token(SamplingParams(ignore_eos=True, stop_token_ids=(4,)), 4, 1, eos)
    assert not stop_token(SamplingParams(min_tokens=2), 9, 2, eos)
    assert stop_token(SamplingParams(min_tokens=2), 9, 3, eos)


def test_detokenizer_options():
    tok = tiny_backbone().tokenizer
    ids = tok("abXYcd", add_special_tokens=False).input_ids

    def run(**kw) -> str:
        d = IncrementalDetokenizer(tok, [], ("XY",), **kw)
        out = "".join(d.add(t) for t in ids if not d.stopped)
        return out + d.flush()

    assert run() == "ab"
    assert run(include_stop=True) == "abXY"
    assert run(min_tokens=4) == "abXYcd"  # XY ends within the first 4 tokens: not looked for
    assert run(min_tokens=3) == "ab"  # the 4th token completes it: found
    special = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert special.add(EOS) + special.flush() == "<|im_end|>"
    plain = IncrementalDetokenizer(tok, [])
    assert plain.add(EOS) + plain.flush() == ""


# -- sampling extensions through the API ------------------------------------------------------------
def test_ignore_eos_and_min_tokens(http):
    forced = {"logit_bias": {str(EOS): 100}, "max_tokens": 6}
    assert complete(http, **forced)["usage"]["completion_tokens"] == 1  # EOS at once
    late = complete(http, **forced, min_tokens=3)
    assert late["usage"]["completion_tokens"] == 4 and late["choices"][0]["finish_reason"] == "stop"
    ignored = complete(http, **forced, ignore_eos=True)
    assert ignored["usage"]["completion_tokens"] == 6 and ignored["choices"][0]["finish_reason"] == "length"
    over = complete(http, **forced, min_tokens=50)  # above max_tokens: every token is generated
    assert over["usage"]["completion_tokens"] == 6


def test_stop_token_ids_and_include_stop_str(http, z):
    forced = {"logit_bias": {str(z): 100}, "max_tokens": 6}
    assert complete(http, **forced)["choices"][0]["text"] == "Z" * 6
    stopped = complete(http, **forced, stop_token_ids=[z])
    assert stopped["choices"][0]["text"] == "" and stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 1
    assert complete(http, **forced, stop_token_ids=[z], include_stop_str_in_output=True)["choices"][0]["text"] == "Z"
    assert complete(http, **forced, stop_token_ids=[z], min_tokens=2)["usage"]["completion_tokens"] == 3
    assert complete(http, **forced, stop=["ZZ"])["choices"][0]["text"] == ""
    assert complete(http, **forced, stop=["ZZ"], include_stop_str_in_output=True)["choices"][0]["text"] == "ZZ"


def test_skip_special_tokens(http):
    forced = {"logit_bias": {str(EOS): 100}, "max_tokens": 2, "ignore_eos": True}
    assert complete(http, **forced)["choices"][0]["text"] == ""
    assert complete(http, **forced, skip_special_tokens=False)["choices"][0]["text"] == "<|im_end|>" * 2


def test_min_p_one_is_greedy(http):
    greedy = complete(http, max_tokens=8)["choices"][0]["text"]
    for seed in (1, 2):
        assert complete(http, max_tokens=8, temperature=1.0, min_p=1.0, seed=seed)["choices"][0]["text"] == greedy


def test_chat_takes_the_extensions(http):
    r = http.post("/v1/chat/completions", json={
        "model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
        "logit_bias": {str(EOS): 100}, "min_tokens": 2, "min_p": 0.1, "skip_special_tokens": True,
        "include_stop_str_in_output": False, "stop_token_ids": [1], "add_special_tokens": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(("extra", "param"), [
    ({"min_p": 1.5}, "min_p"), ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 65}, "min_tokens"),
    ({"stop_token_ids": [100000]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"), ({"max_tokens": 0}, "max_tokens"), ({"prompt": ["a"] * 6}, "prompt"),
    ({"prompt": []}, "prompt"), ({"prompt": [[1], "a"]}, "prompt"), ({"use_beam_search": True}, "use_beam_search"),
])
def test_bad_extensions_are_400_naming_the_field(http, extra, param):
    r = http.post("/v1/completions", json={"model": "alpha", "prompt": "hi", "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


# -- batch prompts ----------------------------------------------------------------------------------
def test_batch_prompts_are_prompt_major_and_equal_single_requests(server, http):
    prompts = ["hello", "Input: x\nOutput:", "abc"]
    submitted = []
    engine = server.runtime.engine
    original = engine.submit

    def counting(req):
        submitted.append(req)
        return original(req)

    engine.submit = counting
    try:
        batch = complete(http, prompt=prompts, n=2, max_tokens=5, logprobs=1)
    finally:
        engine.submit = original
    assert len(submitted) == 3 and [r.params.n for r in submitted] == [2, 2, 2]  # one request (rows) per prompt
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    singles = [complete(http, prompt=p, max_tokens=5, logprobs=1) for p in prompts]
    for i, single in enumerate(singles):
        for j in range(2):
            got = batch["choices"][i * 2 + j]
            assert got["text"] == single["choices"][0]["text"]
            assert got["logprobs"]["tokens"] == single["choices"][0]["logprobs"]["tokens"]
    usage = batch["usage"]
    assert usage["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert usage["completion_tokens"] == 2 * sum(s["usage"]["completion_tokens"] for s in singles)


def test_batch_of_token_id_prompts_and_streaming(server, http):
    tok = server.runtime.tokenizer
    prompts = ["hello", "abc"]
    ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    by_text = complete(http, prompt=prompts, max_tokens=4)
    by_ids = complete(http, prompt=ids, max_tokens=4)
    assert [c["text"] for c in by_ids["choices"]] == [c["text"] for c in by_text["choices"]]
    r = http.post("/v1/completions", json={"model": "alpha", "prompt": ids, "n": 2, "max_tokens": 4, "temperature": 0,
                                           "stream": True, "stream_options": {"include_usage": True}})
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    texts: dict[int, str] = {}
    finished = set()
    for e in events[:-2]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"]:
                finished.add(c["index"])
    assert finished == {0, 1, 2, 3}
    assert [texts[i] for i in range(4)] == [c["text"] for c in by_text["choices"] for _ in range(2)]
    assert events[-2]["usage"]["completion_tokens"] == 2 * by_text["usage"]["completion_tokens"]


# -- scoring ----------------------------------------------------------------------------------------
def plain_forward_logprobs(server, task: str, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1 from one plain forward of the task's adapter, computed
    from the store's routing row (not the server's cache or engine)."""
    from adapters_store.store.directory import DirectoryStore
    from adapters_store.store.materialize import task_weights

    store = DirectoryStore(server.runtime.settings.store_dir)
    record = store.get_task(task)
    weights = task_weights(store.inventory_info(), store.load_weights(record)["logits"].float())
    routed = random_skills(tiny_backbone().model, SPEC, seed=0)  # the skills build_store saved
    routed.set_weights(weights[:, None])
    with torch.inference_mode():
        logits = routed.model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]


def test_scoring_without_generating_equals_a_plain_forward(server, http):
    prompts = ["Input: abc\nOutput: abc", "hello world"]
    tok = server.runtime.tokenizer
    scored = complete(http, prompt=prompts, max_tokens=0, echo=True, logprobs=2)
    assert scored["usage"]["completion_tokens"] == 0
    for prompt, choice in zip(prompts, scored["choices"], strict=True):
        ids = tok(prompt).input_ids
        assert choice["text"] == prompt and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx(plain_forward_logprobs(server, "alpha", ids), abs=1e-4)
        generating = complete(http, prompt=prompt, max_tokens=3, echo=True, logprobs=2)["choices"][0]
        assert generating["logprobs"]["token_logprobs"][: len(ids)] == lp["token_logprobs"]
        assert len(generating["logprobs"]["tokens"]) == len(ids) + 3
    r = http.post("/v1/completions", json={"model": "alpha", "prompt": "hello", "max_tokens": 0, "echo": True,
                                           "stream": True})
    chunks = [c for e in sse(r.text)[:-1] for c in e["choices"]]
    assert "".join(c["text"] for c in chunks) == "hello" and chunks[-1]["finish_reason"] == "length"


# -- /tokenize, /detokenize, /version -------------------------------------------------------------
def test_tokenize_and_detokenize_in_vllm_shapes(server, http):
    tok = server.runtime.tokenizer
    for model in ("base", "alpha"):
        r = http.post("/tokenize", json={"model": model, "prompt": "hello", "return_token_strs": True})
        assert r.status_code == 200, r.text
        body = r.json()
        ids = tok("hello").input_ids
        assert body["tokens"] == ids and body["count"] == len(ids) and body["max_model_len"] > 0
        assert body["token_strs"] == tok.convert_ids_to_tokens(ids)
        back = http.post("/detokenize", json={"model": model, "tokens": ids})
        assert back.status_code == 200 and back.json() == {"prompt": "hello"}
    chat = http.post("/tokenize", json={"model": "base", "messages": [{"role": "user", "content": "hi"}]}).json()
    templated = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok(templated, add_special_tokens=False).input_ids
    task_chat = http.post("/tokenize", json={"model": "alpha", "messages": [{"role": "user", "content": "hi"}]}).json()
    assert task_chat["tokens"] == tok("Input: hi\nOutput:").input_ids
    completion = complete(http, model="alpha", prompt="Input: hi\nOutput:", max_tokens=1)
    assert completion["usage"]["prompt_tokens"] == task_chat["count"]
    missing = http.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    bad = http.post("/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert http.get("/version").json()["version"]


def test_add_special_tokens_and_tokenize_with_a_bos_tokenizer(tmp_path):
    from tokenizers.processors import TemplateProcessing

    bb = tiny_backbone()
    tok = bb.tokenizer
    bos = tok.bos_token_id
    tok._tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    build_store(tmp_path / "store")
    with live_server(settings_for(tmp_path, warmup=False), bb) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        plain = tok("abc", add_special_tokens=False).input_ids
        r = c.post("/tokenize", json={"model": "alpha", "prompt": "abc"}).json()
        assert r["tokens"] == [bos, *plain]
        r = c.post("/tokenize", json={"model": "alpha", "prompt": "abc", "add_special_tokens": False}).json()
        assert r["tokens"] == plain
        for flag, count in ((None, len(plain) + 1), (True, len(plain) + 1), (False, len(plain))):
            extra = {} if flag is None else {"add_special_tokens": flag}
            body = c.post("/v1/completions", json={"model": "alpha", "prompt": "abc", "max_tokens": 1, **extra}).json()
            assert body["usage"]["prompt_tokens"] == count, (flag, body)
        msgs = [{"role": "user", "content": "abc"}]
        base_chat = c.post("/v1/chat/completions", json={"model": "base", "messages": msgs, "max_tokens": 1,
                                                         "add_special_tokens": True}).json()
        default = c.post("/v1/chat/completions", json={"model": "base", "messages": msgs, "max_tokens": 1}).json()
        assert base_chat["usage"]["prompt_tokens"] == default["usage"]["prompt_tokens"] + 1


def test_utility_routes_need_the_api_key(tmp_path):
    build_store(tmp_path / "store")
    with live_server(settings_for(tmp_path, warmup=False, api_keys=["k1"]), tiny_backbone()) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.post("/tokenize", json={"prompt": "x"}).status_code == 401
        assert c.post("/detokenize", json={"tokens": [1]}).status_code == 401
        assert c.get("/version").status_code == 401
        auth = {"Authorization": "Bearer k1"}
        assert c.post("/tokenize", json={"prompt": "x"}, headers=auth).status_code == 200
        assert c.get("/version", headers=auth).status_code == 200
