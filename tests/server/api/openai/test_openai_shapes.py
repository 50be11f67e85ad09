"""The OpenAI response shapes for n, logprobs and echo, engine-agnostic: a scripted engine that
honours the API<->engine contract (server/engines/request.py) stands in for the real one, so the
HTTP layer is checked whatever engine is behind it."""

from __future__ import annotations

import threading

import httpx
import pytest

from server.engines.request import FinalEvent, GenRequest, TokenEvent, TokenLogprob
from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone

openai = pytest.importorskip("openai")



class ScriptedEngine:
    """Choice i generates tokens t(i, 0), t(i, 1)... (max_new_tokens of them); token k has logprob
    -(k + 1) / 10 and alternatives ranked after it; prompt token j > 0 has logprob -j / 10."""

    name = "scripted"

    def __init__(self, real) -> None:
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    @staticmethod
    def token(i: int, k: int) -> int:
        return 66 + (i * 7 + k) % 20  # printable byte tokens of the tiny tokenizer

    def submit(self, req: GenRequest) -> GenRequest:
        threading.Thread(target=self._run, args=(req,), daemon=True).start()
        return req

    def _run(self, req: GenRequest) -> None:
        p = req.params
        tok = self.real.tokenizer
        for i in range(p.n):
            for k in range(p.max_new_tokens):
                t = self.token(i, k)
                lp = -(k + 1) / 10
                entry = None
                if p.logprobs is not None:
                    top = tuple((t if r == 0 else 66 + (t - 66 + r) % 20, lp - r) for r in range(p.logprobs))
                    entry = [TokenLogprob(t, lp, top)]
                req.handle.push(TokenEvent(tok.decode([t]), t, index=i, logprobs=entry))
            prompt = None
            if p.prompt_logprobs is not None:
                prompt = [None] + [TokenLogprob(t, -j / 10, ((t, -j / 10),)) for j, t in
                                   enumerate(req.prompt_ids) if j > 0]
            req.handle.push(FinalEvent("", "length", len(req.prompt_ids), p.max_new_tokens, index=i,
                                       prompt_logprobs=prompt))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    build_store(root / "store")
    with live_server(settings_for(root, warmup=False), tiny_backbone()) as srv:
        real = srv.runtime.engine
        srv.runtime.engine = ScriptedEngine(real)
        try:
            yield srv
        finally:
            srv.runtime.engine = real


@pytest.fixture(scope="module")
def oc(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def expected_text(server, i: int, n_tokens: int) -> str:
    tok = server.runtime.tokenizer
    return "".join(tok.decode([ScriptedEngine.token(i, k)]) for k in range(n_tokens))


def test_n_choices_and_summed_usage(server, oc):
    c = oc.completions.create(model="alpha", prompt="hello", max_tokens=4, n=3)
    assert [ch.index for ch in c.choices] == [0, 1, 2]
    assert [ch.text for ch in c.choices] == [expected_text(server, i, 4) for i in range(3)]
    assert c.usage.completion_tokens == 12 and c.usage.total_tokens == 12 + c.usage.prompt_tokens
    chat = oc.chat.completions.create(model="base", messages=[{"role": "user", "content": "x"}], max_tokens=3, n=2)
    assert [ch.message.content for ch in chat.choices] == [expected_text(server, i, 3) for i in range(2)]


def test_streamed_choices_carry_their_index(server, oc):
    texts: dict[int, str] = {}
    finished = set()
    for chunk in oc.chat.completions.create(model="base", messages=[{"role": "user", "content": "x"}],
                                            max_tokens=3, n=3, stream=True):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1, 2}
    assert texts == {i: expected_text(server, i, 3) for i in range(3)}


def test_chat_logprobs_shape(server, oc):
    chat = oc.chat.completions.create(model="base", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                      logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert [t.logprob for t in content] == pytest.approx([-0.1, -0.2, -0.3])
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
        assert t.bytes == list(t.token.encode())


def test_completion_logprobs_and_echo(server, oc):
    c = oc.completions.create(model="alpha", prompt="hey", max_tokens=3, logprobs=2)
    lp = c.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert lp.text_offset == [0, 1, 2] and "".join(lp.tokens) == c.choices[0].text
    assert all(len(top) == 2 and top[tok] == pytest.approx(v)
               for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True))
    echo = oc.completions.create(model="alpha", prompt="hey", max_tokens=2, logprobs=1, echo=True)
    ch = echo.choices[0]
    assert ch.text == "hey" + expected_text(server, 0, 2)
    assert ch.logprobs.token_logprobs[:3] == [None, pytest.approx(-0.1), pytest.approx(-0.2)]
    assert ch.logprobs.text_offset == list(range(5)) and "".join(ch.logprobs.tokens) == ch.text


def test_streamed_completion_logprobs_offsets(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"model": "alpha", "prompt": "hey", "max_tokens": 3, "logprobs": 1,
                                            "stream": True, "echo": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
        r = c.post("/v1/completions", json={"model": "alpha", "prompt": "hey", "max_tokens": 3, "logprobs": 1,
                                            "stream": True, "n": 2})
    import json

    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    offsets: dict[int, list[int]] = {}
    for chunk in chunks:
        for ch in chunk["choices"]:
            if ch["logprobs"]:
                offsets.setdefault(ch["index"], []).extend(ch["logprobs"]["text_offset"])
    assert offsets == {0: [0, 1, 2], 1: [0, 1, 2]}
