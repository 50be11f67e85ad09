"""Pure pieces of the engine: sampling filters, detokenisation + stop strings, KV surgery, plans."""

from __future__ import annotations

import pytest
import torch

from server.engines.native import kv
from server.engines.native.batch import prefill_groups
from server.engines.native.detok import IncrementalDetokenizer
from server.engines.native.lora_plan import NEVER, auto_threshold, choose_path
from server.engines.native.sampling import RowSampler, apply_top_k, apply_top_p, sample_tokens
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


def test_kv_concat_select_trim():
    def cache(b, t, fill):
        return kv.from_tensors([(torch.full((b, 2, t, 4), fill), torch.full((b, 2, t, 4), -fill))])

    a_mask = torch.ones(2, 3, dtype=torch.long)
    b_mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    c, m = kv.concat(cache(2, 3, 1.0), a_mask, cache(2, 5, 2.0), b_mask)
    assert m.shape == (4, 5) and m[:2, :2].sum() == 0 and m[2:].tolist() == b_mask.tolist()
    keys = c.layers[0].keys
    assert keys.shape == (4, 2, 5, 4) and keys[0, :, :2].abs().sum() == 0 and keys[0, :, 2:].eq(1).all()
    c2, m2 = kv.select(c, m, torch.tensor([0, 1]))  # only the short rows remain: padding trimmed
    assert m2.shape == (2, 3) and c2.layers[0].keys.shape == (2, 2, 3, 4) and c2.layers[0].keys.eq(1).all()
    _, m3 = kv.select(c, m, torch.tensor([0, 1]), min_padding=0.5)  # 2/5 padding < 0.5: kept
    assert m3.shape == (2, 5)


def test_kv_truncate_rolls_back_a_half_written_step():
    cache = kv.new_cache()
    cache.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), 0)
    cache.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), 1)
    cache.update(torch.full((1, 2, 1, 4), 9.0), torch.full((1, 2, 1, 4), 9.0), 0)  # layer 0 only: then a crash
    kv.truncate(cache, 3)
    assert [layer.keys.shape[2] for layer in cache.layers] == [3, 3]
    cache.update(torch.full((1, 2, 1, 4), 5.0), torch.full((1, 2, 1, 4), 5.0), 0)  # the retried step
    assert cache.layers[0].keys.shape[2] == 4 and cache.layers[0].keys[0, 0, 3, 0] == 5.0
    assert cache.layers[0].keys[0, 0, :3].eq(1).all()


def test_left_padding_positions():
    ids, mask = kv.left_padded([[5, 6, 7], [8]], pad_id=0, device=torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert kv.positions(mask).tolist() == [[0, 1, 2], [0, 0, 0]]


def test_prefill_groups_bound_padding():
    reqs = [GenRequest([1] * n, SamplingParams()) for n in (10, 80, 12, 78, 11)]
    groups = prefill_groups(reqs, 0.25)
    assert sorted(len(g) for g in groups) == [2, 3]
    for g in groups:
        lens = [len(r.prompt_ids) for r in g]
        assert max(lens) * len(lens) <= 1.25 * sum(lens)


class _A:
    def __init__(self, weights=True):
        self.weights = torch.zeros(1) if weights else None


def test_cost_rule():
    a, b, c, lora = _A(), _A(), _A(), _A(weights=False)
    assert choose_path([None, None], 2) == "none"
    assert choose_path([a, None, b], 3) == "gathered"
    assert choose_path([a, b, c, a], 3) == "skill"
    assert choose_path([a, b, c, lora], 3) == "gathered"  # plain-LoRA tasks force the gathered path
    assert choose_path([a, a, a, None], NEVER, 3) == "skill"  # the CPU rule counts adapted rows
    assert choose_path([a, a, None], NEVER, 3) == "gathered"
    assert auto_threshold(8, torch.device("cpu")) == (NEVER, 24)
    assert auto_threshold(8, torch.device("cuda")) == (9, NEVER)


def test_derived_row_plans_equal_fresh_ones():
    from types import SimpleNamespace

    from server.adapters.types import Adapter
    from server.engines.native.lora_plan import Planner, RowPlan, build_row_plan

    dims = [(8, 6), (6, 8)]
    gen = torch.Generator().manual_seed(0)

    def adapter(name):
        return Adapter(name, name, "routing", [(torch.randn(i, 2, generator=gen), torch.randn(2, o, generator=gen))
                                              for i, o in dims], torch.zeros(2, 1, 1))

    a, b, c, d = (adapter(n) for n in "abcd")
    layers = [SimpleNamespace(lora_A=torch.zeros(1), batch=None) for _ in dims]
    rm = SimpleNamespace(layers=layers, spec=SimpleNamespace(rank=2, scale=0.5, n_heads=1, n_skills=1),
                         layer_dims=lambda: dims)
    planner = Planner(rm, threshold=100)  # gathered path
    for rows in ([a, b, None, c], [b, None, c], [b, None, c, d, a], [d, d, None], [a]):
        planner.apply(rows)
        got = planner.batch.plan
        want = build_row_plan(rows, dims, 2, 0.5, torch.device("cpu"), torch.float32)
        assert isinstance(got, RowPlan)
        for x, y in zip(got.A + got.B, want.A + want.B, strict=True):
            assert torch.equal(x, y)


def test_native_engine_implements_the_engine_interface(tiny_base, tokenizer):
    from server.engines.base import Engine
    from server.engines.native.engine import NativeEngine

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
