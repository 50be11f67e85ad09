"""Pure pieces of the HTTP layer: error shapes and mapping, engine refusals, logprob objects,
chat rendering rules, temperature floor, path scrubbing."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from adapters_store.backbone.prompt import format_prompt
from server.api import generation
from server.api.errors import ApiError, error_payload, openai_error, scrub
from server.api.openai.chat import render_for_task, task_input
from server.api.openai.format import TokenText, chat_logprobs, completion_logprobs, usage
from server.api.openai.schemas import ChatMessage, effective_temperature
from server.engines.request import GenRequest, RequestHandle, SamplingParams, TokenLogprob


class StubEngine:
    def __init__(self, err: Exception) -> None:
        self.err = err

    def submit(self, req):
        raise self.err


def call_for(names: dict[str, str]) -> generation.Call:
    req = GenRequest([1, 2], SamplingParams(), handle=RequestHandle(None))
    return generation.Call(req, 0.0, "", names)


@pytest.mark.parametrize(("message", "names", "param"), [
    ("n: not supported by the native engine yet", {}, "n"),
    ("logit_bias: not supported by the native engine yet", {}, "logit_bias"),
    ("prompt_logprobs: not supported", {"prompt_logprobs": "echo"}, "echo"),
    ("logprobs: not supported", {"logprobs": "top_logprobs"}, "top_logprobs"),
])
def test_engine_refusing_a_field_is_400_naming_the_request_field(message, names, param):
    rt = SimpleNamespace(engine=StubEngine(ValueError(message)))
    with pytest.raises(ApiError) as info:
        generation.submit(rt, call_for(names))  # type: ignore[arg-type]
    assert (info.value.status, info.value.param, info.value.code) == (400, param, "unsupported_parameter")


def test_engine_refusal_with_a_param_attribute():
    err = ValueError("this engine cannot do that")
    err.param = "repetition_penalty"  # type: ignore[attr-defined]
    rt = SimpleNamespace(engine=StubEngine(err))
    with pytest.raises(ApiError) as info:
        generation.submit(rt, call_for({}))  # type: ignore[arg-type]
    assert info.value.status == 400 and info.value.param == "repetition_penalty"


def test_engine_budget_refusal_is_context_length():
    rt = SimpleNamespace(engine=StubEngine(ValueError("prompt + max_new_tokens = 99999 exceeds max_batch_tokens 16")))
    with pytest.raises(ApiError) as info:
        generation.submit(rt, call_for({}))  # type: ignore[arg-type]
    assert info.value.status == 413 and info.value.code == "context_length_exceeded"
    status, body = openai_error(413, "too_large", "x", code="context_length_exceeded")
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(("status", "type_", "kind", "code"), [
    (404, "not_found", "invalid_request_error", "model_not_found"),
    (401, "unauthorized", "authentication_error", "invalid_api_key"),
    (429, "overloaded", "rate_limit_error", "overloaded"),
    (503, "unavailable", "server_error", "unavailable"),
    (504, "timeout", "server_error", "timeout"),
    (409, "task_not_ready", "invalid_request_error", "task_not_ready"),
])
def test_openai_error_types(status, type_, kind, code):
    out_status, body = openai_error(status, type_, "m")
    assert out_status == status and body == {"error": {"message": "m", "type": kind, "param": None, "code": code}}


def test_validation_is_400_on_openai_routes_and_422_on_ours():
    assert error_payload("/v1/completions", 422, "validation_error", "n: bad", "n")[0] == 400
    assert error_payload("/v1/models/x", 404, "not_found", "m")[1]["error"]["code"] == "model_not_found"
    status, body = error_payload("/v1/generate", 422, "validation_error", "n: bad", "n")
    assert status == 422 and body == {"error": {"type": "validation_error", "message": "n: bad", "param": "n",
                                                "code": None}}


@pytest.mark.parametrize(("message", "clean"), [
    ("open /home/u/.cache/polyserve/store/tasks/a/task.json failed", "open <path> failed"),
    ("bad file ./store/x.json", "bad file <path>"),
    ("task 'alpha' not found", "task 'alpha' not found"),
    ("temperature: must be <= 2.0", "temperature: must be <= 2.0"),
    ("see https://errors.pydantic.dev/2.1/v/x", "see https://errors.pydantic.dev/2.1/v/x"),
])
def test_scrub_removes_paths(message, clean):
    assert scrub(message) == clean


@pytest.mark.parametrize(("value", "out"), [(0.0, 0.0), (1e-38, 0.0), (9e-6, 0.0), (1e-5, 0.01), (0.005, 0.01),
                                            (0.01, 0.01), (0.7, 0.7)])
def test_effective_temperature(value, out):
    assert effective_temperature(value) == out


def test_chat_to_a_task_takes_the_last_user_message():
    msgs = [ChatMessage(role="system", content="be terse"), ChatMessage(role="user", content="a"),
            ChatMessage(role="assistant", content="b"), ChatMessage.model_validate({"role": "user", "content": [
                {"type": "text", "text": "x "}, {"type": "text", "text": "y"}]})]
    assert task_input(msgs) == "x y"
    assert render_for_task(msgs, "input-output") == format_prompt("x y")
    assert task_input(msgs[:3]) == "a"  # the last user message, whatever follows it
    with pytest.raises(ValueError, match="needs a user message"):
        task_input(msgs[:1])
    with pytest.raises(ValueError, match="prompt format"):
        render_for_task(msgs, "some-future-format")


class ByteTok:
    def decode(self, ids):
        return "".join(chr(96 + i) for i in ids)


def test_completion_logprobs_shape_and_offsets():
    text_of = TokenText(ByteTok())
    entries = [None, TokenLogprob(2, -0.5, ((2, -0.5), (3, -1.0))), TokenLogprob(4, -2.0, ((3, -1.0),))]
    out, end = completion_logprobs(text_of, entries, [1, 2, 4], offset=5)
    assert out == {"tokens": ["a", "b", "d"], "token_logprobs": [None, -0.5, -2.0],
                   "top_logprobs": [None, {"b": -0.5, "c": -1.0}, {"c": -1.0, "d": -2.0}],  # + the chosen one
                   "text_offset": [5, 6, 7]}
    assert end == 8


def test_logprobs_are_json_safe():
    text_of = TokenText(ByteTok())
    out = chat_logprobs(text_of, [TokenLogprob(1, float("-inf"), ((1, float("nan")),))], k=1)
    item = out["content"][0]
    assert item["logprob"] == -9999.0 and item["top_logprobs"][0]["logprob"] == -9999.0
    assert item["bytes"] == [97] and out["refusal"] is None


def test_usage_sums_choices():
    from server.engines.request import FinalEvent

    finals = [FinalEvent("", "stop", 7, 3, index=0, cached_tokens=4),
              FinalEvent("", "length", 7, 5, index=1, cached_tokens=4)]
    assert usage(finals) == {"prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 4}}


def test_collect_times_out_and_cancels_the_row():
    async def scenario():
        loop = asyncio.get_running_loop()
        req = GenRequest([1], SamplingParams(), handle=RequestHandle(loop))
        call = generation.Call(req, loop.time() + 0.05, "", {})

        class NeverDisconnects:
            async def receive(self):
                await asyncio.sleep(3600)

        with pytest.raises(ApiError) as info:
            await generation.collect(NeverDisconnects(), call)  # type: ignore[arg-type]
        return info.value, req

    err, req = asyncio.run(scenario())
    assert err.status == 504 and err.type == "timeout" and req.handle.cancelled.is_set()


def test_tiny_top_p_keeps_the_same_single_token():
    """top_p 5e-324 became 0 in float32 and dropped every token (found by the fuzzer); the floor
    keeps exactly the most likely token, as any top_p below its probability does."""
    import torch

    from server.api.openai.schemas import effective_top_p
    from server.engines.native.sample.sampling import apply_top_p

    logits = torch.randn(50_000, generator=torch.Generator().manual_seed(0))
    kept = apply_top_p(logits, effective_top_p(5e-324))
    assert torch.isfinite(kept).sum() == 1 and int(kept.argmax()) == int(logits.argmax())
    assert effective_top_p(0.3) == 0.3


def test_token_bytes_of_a_byte_level_tokenizer():
    """A token that is part of a UTF-8 character keeps its true bytes (chat `bytes`) and is written
    `bytes:\\x..` (legacy `tokens`); offsets count whole characters."""
    from adapters_store.backbone.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    text_of = TokenText(tok)
    ids = tok("é!", add_special_tokens=False).input_ids  # é is two bytes: two byte tokens
    assert [text_of.bytes(i) for i in ids] == [b"\xc3", b"\xa9", b"!"]
    assert [text_of(i) for i in ids] == ["bytes:\\xc3", "bytes:\\xa9", "!"]
    out, end = completion_logprobs(text_of, [TokenLogprob(i, -1.0) for i in ids], ids)
    assert out["text_offset"] == [0, 0, 1] and end == 2
    assert text_of(tok.bos_token_id) == "<|im_start|>"


@pytest.mark.parametrize("n", [1, 9, 10, 11, 99, 100, 101, 259, 1000, 1234, 49152, 151936])
def test_below_pattern_matches_exactly_the_ids_below_n(n):
    import re

    from server.api.api_docs import below_pattern

    pattern = re.compile(below_pattern(n))
    probe = range(min(n + 200, 200_000))
    assert [x for x in probe if pattern.fullmatch(str(x))] == list(range(min(n, len(probe))))
    assert not pattern.fullmatch("0" + str(n - 1))  # no leading zeros
    assert not pattern.fullmatch(str(n)) and not pattern.fullmatch("-1")
