"""Pure pieces of the engine: sampling filters, detokenisation + stop strings, request checks.
(The step layout, KV slots and slot LoRA tables: tests/server/engines/native/core/test_slots.py.)"""

from __future__ import annotations

import pytest
import torch

from server.engines.native.sample.detok import IncrementalDetokenizer
from server.engines.native.sample.sampling import RowSampler, apply_top_k, apply_top_p, sample_tokens
from server.engines.request import GenRequest, SamplingParams


def test_top_k_and_top_p():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    assert torch.isinf(apply_top_k(logits, 2)).tolist() == [True, False, False, True]
    assert torch.equal(apply_top_k(logits, 0), logits)
    probs = torch.softmax(logits, -1)  # ~[.09, .64, .24, .03]
    kept = ~torch.isinf(apply_top_p(logits, 0.7))
    assert kept.tolist() == [False, True, True, False]
    assert (~torch.isinf(apply_top_p(logits, 0.5))).tolist() == [False, True, False, False]
    assert probs.argmax() == 1


def test_sample_tokens_greedy_and_seeded():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))

    def rows():
        return [RowSampler(), RowSampler(1.0, generator=torch.Generator().manual_seed(5)),
                RowSampler(1.0, generator=torch.Generator().manual_seed(5))]

    out = sample_tokens(logits, rows())
    assert out.tokens[0] == int(logits[0].argmax())
    assert out.errors == [None] * 3 and out.logprobs == [None] * 3
    assert sample_tokens(logits, rows()).tokens == out.tokens
    # rows 1 and 2 share a seed but not the logits: each draws from its own row
    draws = {sample_tokens(logits[1:2], [RowSampler(1.0, generator=torch.Generator().manual_seed(s))]).tokens[0]
             for s in range(40)}
    assert len(draws) > 5  # really sampled, not argmax


@pytest.mark.parametrize("text", ["héllo wörld ✓ done", "abc STOP def", "a\nb\n\nc"])
def test_incremental_detok_equals_full_decode(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    d = IncrementalDetokenizer(tokenizer, [1, 2, 3])
    out = "".join(d.add(t) for t in ids) + d.flush()
    assert out == tokenizer.decode(ids)


def test_stop_string_is_cut_and_never_streamed(tokenizer):
    ids = tokenizer("abc STOP def", add_special_tokens=False).input_ids
    d = IncrementalDetokenizer(tokenizer, [], stops=("STOP",))
    pieces = []
    for t in ids:
        pieces.append(d.add(t))
        if d.stopped:
            break
    pieces.append(d.flush())
    assert "".join(pieces) == "abc "
    assert all("S" not in p for p in pieces)


def test_held_back_prefix_is_released_when_no_stop_follows(tokenizer):
    ids = tokenizer("abc ST end", add_special_tokens=False).input_ids
    d = IncrementalDetokenizer(tokenizer, [], stops=("STOP",))
    out = "".join(d.add(t) for t in ids) + d.flush()
    assert out == "abc ST end" and not d.stopped


def test_native_engine_implements_the_engine_interface(tiny_base, tokenizer):
    from server.engines.base import Engine
    from server.engines.native.core.engine import NativeEngine

    engine = NativeEngine(tiny_base, tokenizer)
    assert isinstance(engine, Engine)
    assert not engine.alive  # not started


@pytest.mark.parametrize("field,value", [("n", 0), ("logprobs", -1), ("logprobs", 21), ("prompt_logprobs", 10**6),
                                         ("presence_penalty", 2.5),
                                         ("frequency_penalty", -3.0), ("repetition_penalty", 0.0),
                                         ("temperature", float("inf")), ("logit_bias", ((5, 101.0),))])
def test_sampling_params_refuse_out_of_range_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_handle_is_done_after_one_final_event_per_choice():
    from server.engines.request import FinalEvent

    req = GenRequest([1, 2], SamplingParams(n=3, temperature=1.0))
    for i in range(2):
        req.handle.push(FinalEvent("", "length", 2, 1, index=i))
        assert not req.handle.done
    req.handle.push(FinalEvent("", "length", 2, 1, index=2))
    assert req.handle.done
