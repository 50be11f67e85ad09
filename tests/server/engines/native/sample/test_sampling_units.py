"""Pure pieces of the native engine's sampling and fault isolation: processors (bias, penalties),
logprobs, safe sampling math, culprit bisection, the final-event ledger."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch

from server.engines.native.core.isolate import find_culprits
from server.engines.native.core.ledger import FinalLedger, answer_unadmitted, deliver
from server.engines.native.sample.logprobs import prompt_chunk_logprobs, token_logprobs
from server.engines.native.sample.processors import RowProcessors, apply_penalties, apply_processors
from server.engines.native.sample.rows import describe, new_rows, sample_rows, vocab_size
from server.engines.native.sample.sampling import (
    RowSampler,
    SamplingError,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    draw,
    nucleus,
    sample_row,
    sample_tokens,
    scale,
    top_k_members,
)
from server.engines.request import FinalEvent, GenRequest, SamplingParams

V = 12


def reference_processed(logits: list[float], prompt: list[int], generated: list[int], p: SamplingParams) -> list[float]:
    """The documented formulas, one token at a time (independent of the vectorised code)."""
    out = list(logits)
    for token, bias in p.logit_bias:
        out[token] += bias
    seen = set(prompt) | set(generated)
    for t in range(len(out)):
        if t in seen:
            r = p.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        count = generated.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (1 if count else 0)
    return out


CASES = [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(frequency_penalty=-1.0, presence_penalty=-0.5),  # negative: encourage repeats
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.5),
    SamplingParams(logit_bias=((3, 100.0), (7, -100.0))),
    SamplingParams(presence_penalty=0.3, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias=((2, 5.0),)),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: "-".join(
    f"{k}" for k in ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
    if getattr(p, k) != getattr(SamplingParams(), k)))
def test_processors_equal_the_reference_formulas(params):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(V, generator=gen) * 3
    prompt, generated = [1, 2, 2, 9], [4, 4, 4, 5, 1]
    procs = RowProcessors.build(params, prompt, V)
    assert procs is not None
    for t in generated:
        procs.observe(t)
    got = apply_processors(logits[None], [procs])[0]
    want = torch.tensor(reference_processed(logits.tolist(), prompt, generated, params))
    torch.testing.assert_close(got, want)


def test_processors_are_vectorised_per_row_and_leave_the_input_alone():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, V, generator=gen)
    before = logits.clone()
    rows = [RowProcessors.build(p, [0, 1], V) for p in CASES[:3]]
    histories = [[3], [3, 3, 8], []]
    for procs, history in zip(rows, histories, strict=True):
        for t in history:
            procs.observe(t)  # type: ignore[union-attr]
    together = apply_processors(logits, rows)  # type: ignore[arg-type]
    for n in range(3):
        alone = apply_processors(logits[n : n + 1], [rows[n]])[0]  # type: ignore[list-item]
        torch.testing.assert_close(together[n], alone)
    assert torch.equal(logits, before)


def test_apply_penalties_table():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5], [1.0, 1.0, 1.0, 1.0]])
    rows, tokens = torch.tensor([0, 0, 0, 1]), torch.tensor([0, 1, 2, 3])
    counts = torch.tensor([1.0, 2.0, 0.0, 3.0])  # token 2 of row 0: in the prompt only
    out = apply_penalties(logits.clone(), rows, tokens, counts, torch.tensor([0.5, 0.5, 0.5, 0.0]),
                          torch.tensor([0.25, 0.25, 0.25, 0.1]), torch.tensor([2.0, 2.0, 2.0, 1.0]))
    # t0: 2/2 - 0.25 - 0.5; t1: -2*2 - 0.5 - 0.5; t2 (prompt only): 1/2; t3 untouched; row 1: 1 - 0.3
    torch.testing.assert_close(out, torch.tensor([[0.25, -5.0, 0.5, 0.5], [1.0, 1.0, 1.0, 0.7]]))


def test_row_processors_build_fork_and_bounds():
    assert RowProcessors.build(SamplingParams(), [1], V) is None
    assert RowProcessors.build(SamplingParams(logit_bias=((3, 0.0),)), [1], V) is None  # a zero bias is no-op
    procs = RowProcessors.build(SamplingParams(frequency_penalty=1.0, repetition_penalty=1.2), [1, 5, 1], V)
    assert procs is not None and procs.seen is not None
    assert procs.seen.tokens[: procs.seen.size].tolist() == [1, 5]  # the prompt, once each
    other = procs.fork()
    for _ in range(70):  # past the first buffer: it grows
        procs.observe(4)
        procs.observe(len(procs.seen.where) % V)
    assert procs.seen.counts[procs.seen.where[4]] >= 70
    assert other.seen is not None and other.seen.size == 2 and other.seen.counts.sum() == 0
    no_rep = RowProcessors.build(SamplingParams(presence_penalty=1.0), [1, 5], V)
    assert no_rep is not None and no_rep.seen is not None and no_rep.seen.size == 0  # prompt only matters to r
    with pytest.raises(ValueError, match="logit_bias"):
        RowProcessors.build(SamplingParams(logit_bias=((V, 1.0),)), [1], V)


def test_a_fork_and_its_origin_count_their_own_tokens():
    """fork() copies the state: what one side observes, the other never sees (both directions)."""
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.3)
    prompt = [1, 2, 2, 9]
    origin = RowProcessors.build(params, prompt, V)
    assert origin is not None
    forked = origin.fork()
    for t in [4, 4, 1]:
        origin.observe(t)
    for t in [7, 2]:
        forked.observe(t)
    logits = torch.randn(V, generator=torch.Generator().manual_seed(4)) * 3
    for procs, own in ((origin, [4, 4, 1]), (forked, [7, 2])):
        got = apply_processors(logits[None], [procs])[0]
        torch.testing.assert_close(got, torch.tensor(reference_processed(logits.tolist(), prompt, own, params)))


@pytest.mark.parametrize("params", [
    SamplingParams(n=3, frequency_penalty=0.7, presence_penalty=0.5, repetition_penalty=1.3),
    SamplingParams(n=3, frequency_penalty=1.0, temperature=1.0, seed=3, logit_bias=((3, 2.0),)),
], ids=["greedy", "seeded"])
def test_each_choice_of_a_request_has_its_own_processor_state(tokenizer, params):
    """The n choices of one request: observing one choice's tokens leaves the others' counts unchanged."""
    prompt = [1, 2, 2, 9]
    rows = new_rows(GenRequest(prompt, params), tokenizer, V, torch.device("cpu"))
    own = {0: [4, 4, 1], 1: [], 2: [7]}
    for index, tokens in own.items():
        for t in tokens:
            rows[index].sampler.processors.observe(t)  # type: ignore[union-attr]
    logits = torch.randn(V, generator=torch.Generator().manual_seed(5)) * 3
    for index, tokens in own.items():
        got = apply_processors(logits[None], [rows[index].sampler.processors])[0]  # type: ignore[list-item]
        want = reference_processed(logits.tolist(), prompt, tokens, params)
        torch.testing.assert_close(got, torch.tensor(want), msg=f"choice {index}")


def test_many_generated_tokens_grow_the_seen_buffers_and_stay_exact():
    params = SamplingParams(presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.1)
    gen = torch.Generator().manual_seed(9)
    vocab = 500
    prompt = torch.randint(0, vocab, (100,), generator=gen).tolist()
    generated = torch.randint(0, vocab, (300,), generator=gen).tolist()
    procs = RowProcessors.build(params, prompt, vocab)
    assert procs is not None
    for t in generated:
        procs.observe(t)
    logits = torch.randn(vocab, generator=gen) * 4
    got = apply_processors(logits[None], [procs])[0]
    torch.testing.assert_close(got, torch.tensor(reference_processed(logits.tolist(), prompt, generated, params)))


def test_sample_rows_samples_the_batch_in_one_call(monkeypatch):
    """The row-by-row path is only a fallback after the batched call raised: when nothing fails,
    one sample_tokens call over every row (not one per row: same tokens, n times the work)."""
    import server.engines.native.sample.rows as rows_module

    calls = []
    real = rows_module.sample_tokens

    def spy(logits, samplers):
        calls.append((logits.shape[0], len(samplers)))
        return real(logits, samplers)

    monkeypatch.setattr(rows_module, "sample_tokens", spy)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(6))
    rows = [SimpleNamespace(sampler=RowSampler(0.0, 0, 1.0, None, None, None)) for _ in range(3)]
    out = sample_rows(rows, logits)  # type: ignore[arg-type]
    assert calls == [(3, 3)] and out.tokens == logits.argmax(-1).tolist() and out.errors == [None] * 3


def test_sample_rows_falls_back_row_by_row_and_fails_only_the_row_that_fails_alone(monkeypatch, caplog):
    """The batched call raised: each row is sampled alone, in order; a row whose own sampling
    raises gets token -1 and an error naming the failure, the others their tokens."""
    import server.engines.native.sample.rows as rows_module

    real = rows_module.sample_tokens
    seen = []

    def flaky(logits, samplers):
        seen.append(logits.shape[0])
        if len(samplers) > 1 or samplers[0] is bad:
            raise RuntimeError("kernel exploded")
        return real(logits, samplers)

    monkeypatch.setattr(rows_module, "sample_tokens", flaky)
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(7))
    samplers = [RowSampler(0.0, 0, 1.0, None, None, 2 if i == 3 else None) for i in range(4)]
    bad = samplers[1]
    with caplog.at_level("ERROR", logger="polyserve.engine"):
        out = sample_rows([SimpleNamespace(sampler=s) for s in samplers], logits)  # type: ignore[arg-type]
    assert "batched sampling failed; sampling row by row" in caplog.text
    assert seen == [4, 1, 1, 1, 1]
    want = logits.argmax(-1).tolist()
    assert out.tokens == [want[0], -1, want[2], want[3]]
    assert out.errors == [None, "sampling failed: RuntimeError: kernel exploded", None, None]
    assert out.logprobs[:3] == [None, None, None] and out.logprobs[3].token_id == want[3]


def test_new_rows_give_each_choice_the_requests_stop_strings_and_logprobs_state(tokenizer):
    """Each choice's detokenizer knows the prompt and the stop strings; pending logprobs are a
    list only when logprobs were asked for (None otherwise: no logprobs field is sent)."""
    prompt = list(tokenizer("say: ", add_special_tokens=False).input_ids)
    params = SamplingParams(n=2, stop=("xy",), logprobs=1)
    rows = new_rows(GenRequest(prompt, params), tokenizer, 259, torch.device("cpu"))
    for row in rows:
        assert row.pending_logprobs == []
        for t in tokenizer("axyb", add_special_tokens=False).input_ids:
            row.detok.add(t)
        assert row.detok.stopped
    plain = new_rows(GenRequest(prompt, SamplingParams()), tokenizer, 259, torch.device("cpu"))
    assert plain[0].pending_logprobs is None


def test_describe_names_the_error_type_and_stays_short():
    assert describe(ValueError("bad row")) == "ValueError: bad row"
    long = describe(RuntimeError("x" * 1000))
    assert len(long) == 300 and long.startswith("RuntimeError: xxx")


def test_vocab_size_is_the_heads_rows_else_the_config(tiny_base):
    assert vocab_size(tiny_base) == 259

    class Padded(torch.nn.Module):  # a head padded past config.vocab_size: the logits' width counts
        config = SimpleNamespace(vocab_size=259)

        def get_output_embeddings(self):
            return torch.nn.Linear(8, 320, bias=False)

    class HeadWithoutWeight(Padded):
        def get_output_embeddings(self):
            return None

    class NoHead(torch.nn.Module):
        config = SimpleNamespace(vocab_size=261)

    assert vocab_size(Padded()) == 320
    assert vocab_size(HeadWithoutWeight()) == 259
    assert vocab_size(NoHead()) == 261


def test_token_logprobs_are_raw_log_softmax_with_sorted_top_k():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, V, generator=gen)
    entries = token_logprobs(logits, [4, 7], [3, 0])
    ref = torch.log_softmax(logits, -1)
    assert [e.token_id for e in entries] == [4, 7]
    assert entries[0].logprob == pytest.approx(float(ref[0, 4]), abs=1e-6)
    assert entries[1].logprob == pytest.approx(float(ref[1, 7]), abs=1e-6)
    assert entries[1].top == ()
    top = entries[0].top
    assert [t for t, _ in top] == ref[0].topk(3).indices.tolist()
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    assert math.fsum(math.exp(v) for v in ref[0].tolist()) == pytest.approx(1.0)


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_prompt_logprobs_equal_full_log_softmax_whatever_the_chunk(chunk):
    """The engine prefills a prompt in chunks; the chunks' entries concatenate to the entries of
    one log_softmax over the whole prompt (position i - 1 predicts token i; the last position
    predicts a generated token, not a prompt token)."""
    gen = torch.Generator().manual_seed(4)
    ids = [3, 1, 4, 1, 5, 9, 2]
    logits = torch.randn(len(ids), V, generator=gen)
    out: list = [None]
    for start in range(0, len(ids), chunk):
        out += prompt_chunk_logprobs(logits[start : start + chunk], ids, start, 2)
    ref = torch.log_softmax(logits, -1)
    assert len(out) == len(ids)
    for i in range(1, len(ids)):
        entry = out[i]
        assert entry is not None and entry.token_id == ids[i]
        assert entry.logprob == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-5)
        assert [t for t, _ in entry.top] == ref[i - 1].topk(2).indices.tolist()


def test_infinite_logits_share_the_mass_and_nan_fails():
    inf = float("inf")
    gen = torch.Generator().manual_seed(0)
    draws = {sample_row(torch.tensor([inf, 1.0, inf]), 0.5, 0, 1.0, gen) for _ in range(40)}
    assert draws == {0, 2}
    with pytest.raises(SamplingError):
        sample_row(torch.tensor([float("nan"), 1.0]), 1.0, 0, 1.0, gen)
    with pytest.raises(SamplingError):
        sample_row(torch.tensor([-inf, -inf]), 1.0, 0, 0.5, gen)


def test_scale_is_finite_non_positive_with_a_zero_max():
    inf = float("inf")
    out = scale(torch.tensor([3e38, -3e38, 1.0]), 1e-5)
    assert out.tolist()[0] == 0.0 and out.max() == 0 and not torch.isnan(out).any()
    assert scale(torch.tensor([inf, 1.0, inf, -inf]), 0.5).tolist() == [0.0, -inf, 0.0, -inf]
    with pytest.raises(SamplingError):
        scale(torch.tensor([1.0, float("nan"), 2.0]), 1.0)  # a NaN anywhere
    with pytest.raises(SamplingError):
        scale(torch.tensor([-inf, -inf]), 1.0)


@pytest.mark.parametrize("temperature,top_k,top_p,size", [
    (1e-5, 0, 1.0, 1.0), (1e-5, 0, 1.0, 1e6), (1.0, 0, 1e-9, 1.0), (1e-5, 1, 1e-9, 1e30), (2.0, 3, 0.5, 1e38),
    (1e-5, 0, 1.0, 1e38),  # 3e38 / 1e-5 would overflow: scaled as (l - max) / T it cannot
])
def test_sample_row_is_safe_on_extreme_inputs(temperature, top_k, top_p, size):
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0]) * size
    gen = torch.Generator().manual_seed(0)
    draws = {sample_row(logits, temperature, top_k, top_p, gen) for _ in range(20)}
    assert draws == {1}  # tiny temperature / nucleus / huge logits: the best token, never an error


def test_top_p_keeps_the_best_token_however_small_p():
    logits = torch.tensor([0.0, 0.0, 5.0])
    assert (~torch.isinf(apply_top_p(logits, 1e-12))).tolist() == [False, False, True]
    assert (~torch.isinf(apply_top_p(logits, 0.0))).tolist() == [False, False, True]


def reference_nucleus(logits: torch.Tensor, p: float) -> set[int]:
    """The definition, in float64 and one token at a time: best first, a token stays while the
    mass before it is below p."""
    probs = torch.softmax(logits.double(), dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        if kept and mass >= p:
            break
        kept.add(i)
        mass += probs[i]
    return kept


@pytest.mark.parametrize("spread,p", [
    (8.0, 0.9),    # a peaked row: the nucleus is a handful of the first candidates
    (2.0, 0.7),    # ~3,300 tokens: past the first candidates, within the second
    (3.0, 0.9),
    (0.01, 0.9),   # nearly flat: ~44,000 tokens, ranked by the full sort
])
def test_top_p_keeps_the_reference_nucleus_wherever_it_ends(spread, p):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(49152, generator=gen) * spread
    kept = {int(i) for i in (~torch.isinf(apply_top_p(logits, p))).nonzero()[:, 0]}
    assert kept == reference_nucleus(logits, p)


def test_top_p_ranks_only_as_many_tokens_as_the_nucleus_needs(monkeypatch):
    calls: list[int] = []
    topk = torch.topk
    monkeypatch.setattr(torch, "topk", lambda x, k, *a, **kw: calls.append(k) or topk(x, k, *a, **kw))
    gen = torch.Generator().manual_seed(3)
    apply_top_p(torch.randn(49152, generator=gen) * 8.0, 0.9)
    assert calls == [256]
    calls.clear()
    apply_top_p(torch.randn(49152, generator=gen) * 2.0, 0.7)
    assert calls == [256, 4096]
    calls.clear()
    apply_top_p(torch.randn(49152, generator=gen) * 0.01, 0.9)
    assert calls == [256, 4096]  # then the full sort


def whole_vocabulary_draw(logits, temperature, top_k, top_p, gen, min_p=0.0) -> int:
    """The draw over every token of the vocabulary, the tokens out of the nucleus weighing 0."""
    scaled = apply_top_p(apply_top_k(apply_min_p(scale(logits.float(), temperature), min_p), top_k), top_p)
    return draw(scaled.exp_(), gen)


def tied_logits(gen: torch.Generator) -> torch.Tensor:
    """Logits on a coarse grid: ties at every level, the nucleus's last level included."""
    return (torch.randn(49152, generator=gen) * 3.0).round()


@pytest.mark.parametrize("make,temperature,top_k,top_p,min_p", [
    (lambda g: torch.randn(49152, generator=g) * 8.0, 0.8, 0, 0.9, 0.0),   # a few tokens: the first candidates
    (lambda g: torch.randn(49152, generator=g) * 2.0, 1.0, 0, 0.7, 0.0),   # thousands: the second candidates
    (lambda g: torch.randn(49152, generator=g) * 0.01, 1.0, 0, 0.9, 0.0),  # nearly flat: the full sort
    (lambda g: torch.randn(49152, generator=g) * 3.0, 0.5, 50, 0.95, 0.0),  # top-k first
    (lambda g: torch.randn(49152, generator=g) * 3.0, 1.3, 0, 0.99, 0.05),  # min-p first
    (tied_logits, 1.0, 0, 0.9, 0.0),
    (lambda g: torch.randn(49152, generator=g) * 3.0, 0.8, 50, 1.0, 0.0),   # top-k alone: its members
    (lambda g: torch.randn(49152, generator=g) * 3.0, 1.0, 5000, 1.0, 0.0),  # a long top-k: the mask
    (tied_logits, 1.0, 50, 1.0, 0.0),                                          # the k-th tied past k: the mask
    (lambda g: torch.randn(49152, generator=g) * 3.0, 1.0, 40, 1.0, 0.9),   # min-p leaves fewer than k: -inf ties
])
def test_a_draw_among_the_nucleus_gives_the_token_the_whole_vocabulary_draw_gives(
        make, temperature, top_k, top_p, min_p):
    """The sampler draws among the nucleus's members only; with the same uniform it must pick the
    token the inverse CDF over the whole vocabulary (every other token weighing 0) picks, so a
    seeded request's text does not depend on which of the two ran."""
    shape = torch.Generator().manual_seed(11)
    for row in range(4):
        logits = make(shape)
        for seed in range(25):
            got = sample_row(logits, temperature, top_k, top_p, torch.Generator().manual_seed(seed), min_p)
            want = whole_vocabulary_draw(logits, temperature, top_k, top_p, torch.Generator().manual_seed(seed), min_p)
            assert got == want, (row, seed)


def test_the_nucleus_members_are_every_kept_token_or_none_past_the_partial_ranking():
    gen = torch.Generator().manual_seed(5)
    for logits, p in ((torch.randn(49152, generator=gen) * 8.0, 0.8),  # a handful: the first candidates
                      (torch.randn(49152, generator=gen) * 2.0, 0.7),  # thousands: the second
                      (tied_logits(gen), 0.8)):
        threshold, members = nucleus(logits, p)
        assert members is not None
        index, values = members
        assert index.tolist() == (logits >= threshold).nonzero()[:, 0].tolist()  # ascending, ties included
        assert torch.equal(values, logits[index])
    # nearly flat: the full sort ranks ~40,000 members, which the threshold's mask handles
    flat = torch.randn(49152, generator=gen) * 0.01
    threshold, members = nucleus(flat, 0.8)
    assert members is None and torch.equal(apply_top_p(flat, 0.8) > float("-inf"), flat >= threshold)
    # 300 tokens tied at the top, p = 0.5: the first 256 ranked hold the nucleus, the tie runs past them
    logits = torch.cat([torch.zeros(300), torch.full((49152 - 300,), -50.0)])
    threshold, members = nucleus(logits, 0.5)
    assert members is None and int((logits >= threshold).sum()) == 300
    assert int((~torch.isinf(apply_top_p(logits, 0.5))).sum()) == 300
    gen_a, gen_b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert sample_row(logits, 1.0, 0, 0.5, gen_a) == whole_vocabulary_draw(logits, 1.0, 0, 0.5, gen_b)


def test_a_row_with_a_short_list_of_kept_tokens_draws_among_them_not_over_the_vocabulary(monkeypatch):
    """The point of the members: the draw's exp and cumulative sum run over the kept tokens only."""
    from server.engines.native.sample import sampling

    sizes: list[int] = []
    real_draw = sampling.draw
    monkeypatch.setattr(sampling, "draw", lambda w, g: sizes.append(len(w)) or real_draw(w, g))
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(49152, generator=gen) * 3.0
    sample_row(logits, 0.8, 50, 1.0, gen)  # top-k alone
    sample_row(logits, 0.8, 0, 0.5, gen)   # top-p: its nucleus
    sample_row(logits, 0.8, 0, 1.0, gen)   # neither: the whole vocabulary
    nucleus_size = len(nucleus(scale(logits, 0.8), 0.5)[1][0])
    assert sizes == [50, nucleus_size, 49152] and nucleus_size < 4096


def test_top_k_members_are_the_kept_tokens_ascending_or_none_where_the_kth_is_tied_past_k():
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(49152, generator=gen)
    index, values = top_k_members(logits, 50)
    assert index.tolist() == (~torch.isinf(apply_top_k(logits, 50))).nonzero()[:, 0].tolist()
    assert torch.equal(values, logits[index])
    tied = torch.tensor([3.0, 1.0, 2.0, 2.0, 0.0])
    assert top_k_members(tied, 2) is None  # 2.0 is the 2nd and the 3rd best: top-k keeps both
    assert top_k_members(tied, 3)[0].tolist() == [0, 2, 3]
    assert top_k_members(logits, 0) is None and top_k_members(logits, 5000) is None


def test_top_p_keeps_every_token_tied_with_the_last_one_kept():
    # four equal tokens, p = 0.3: the mass reaches p after two; which two would be a sort's choice
    assert (~torch.isinf(apply_top_p(torch.tensor([1.0, 1.0, 1.0, 1.0, -2.0]), 0.3))).tolist() == [True] * 4 + [False]
    # -inf entries (an earlier filter) stay out, even when the finite tokens' mass rounds below p
    logits = torch.tensor([0.0, float("-inf"), 0.0, float("-inf")])
    assert (~torch.isinf(apply_top_p(logits, 1 - 1e-12))).tolist() == [True, False, True, False]


def test_sample_tokens_fails_only_the_nan_row_and_greedy_uses_processed_logits():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, V, generator=gen)
    logits[2, 3] = float("nan")
    bias = RowProcessors.build(SamplingParams(logit_bias=((6, 100.0),)), [0], V)
    rows = [RowSampler(), RowSampler(processors=bias, logprobs=2), RowSampler(),
            RowSampler(1e-5, generator=torch.Generator().manual_seed(0), processors=bias)]
    out = sample_tokens(logits, rows)
    assert out.errors[2] is not None and "NaN" in out.errors[2] and out.tokens[2] == -1
    assert out.errors[:2] == [None, None] and out.errors[3] is None
    assert out.tokens[0] == int(logits[0].argmax())
    assert out.tokens[1] == 6 and out.tokens[3] == 6  # bias forces the token, greedy and sampled
    lp = out.logprobs[1]
    assert lp is not None and lp.token_id == 6  # the chosen token's RAW logprob (bias not applied)
    assert lp.logprob == pytest.approx(float(torch.log_softmax(logits[1], -1)[6]), abs=1e-6)
    assert out.logprobs[0] is None and out.logprobs[3] is None


def test_sample_tokens_common_path_is_plain_argmax():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(6))
    out = sample_tokens(logits, [RowSampler() for _ in range(5)])
    assert out.tokens == logits.argmax(-1).tolist() and out.errors == [None] * 5


@pytest.mark.parametrize("n,culprits", [(1, []), (1, [0]), (8, [3]), (8, [0, 7]), (7, [1, 2, 3, 4, 5, 6]), (16, [])])
def test_find_culprits_finds_exactly_the_rows_that_fail_alone(n, culprits):
    probes: list[list[int]] = []

    def probe(rows):
        probes.append(rows)
        return not set(rows) & set(culprits)

    assert find_culprits(range(n), probe) == culprits
    if len(culprits) == 1 and n > 1:
        assert len(probes) <= 2 * math.ceil(math.log2(n))  # bisection, not one probe per row


@pytest.mark.parametrize("culprit", [True, False])
def test_find_culprits_never_probes_an_empty_subset(culprit):
    """One row: one probe of that row (an empty forward is not a probe: a step needs an item)."""
    probes: list[list[int]] = []

    def probe(rows):
        assert rows, "probed an empty subset"
        probes.append(rows)
        return not culprit

    assert find_culprits([5], probe) == ([5] if culprit else [])
    assert probes == [[5]]


def test_find_culprits_returns_none_when_only_a_combination_fails():
    assert find_culprits(range(6), lambda rows: len(rows) < 3) == []


def test_ledger_sends_each_choice_exactly_once():
    ledger = FinalLedger()
    req = GenRequest([1, 2, 3], SamplingParams(n=3))
    ledger.open(req)
    assert len(ledger) == 3 and ledger.owes(req, 1)
    assert ledger.send(req, FinalEvent("x", "stop", 3, 1, index=1))
    assert not ledger.send(req, FinalEvent("y", "stop", 3, 1, index=1))  # duplicate dropped
    assert not ledger.owes(req, 1) and len(ledger) == 2
    assert ledger.fail_open("boom") == 2
    finals = req.handle.events
    assert sorted(e.index for e in finals) == [0, 1, 2] and req.handle.done
    assert [e.error for e in finals if e.index != 1] == ["boom", "boom"]
    assert ledger.fail_open("again") == 0 and len(ledger) == 0


def test_ledger_error_finals_carry_nothing_generated_and_the_prompt_count():
    """fail_open's finals (default reason "cancelled") and answer_unadmitted's: no text, no
    completion tokens, the prompt's token count, the message, every owed index once."""
    ledger = FinalLedger()
    req = GenRequest([5, 6, 7, 8], SamplingParams(n=2))
    ledger.open(req)
    assert ledger.fail_open("engine stopped") == 2
    waiting = GenRequest([1, 2], SamplingParams(n=3))
    answer_unadmitted(waiting, "length", "queue closed")
    for request, reason, message, n in ((req, "cancelled", "engine stopped", 2),
                                        (waiting, "length", "queue closed", 3)):
        finals = request.handle.events
        assert [(f.text, f.finish_reason, f.prompt_tokens, f.completion_tokens, f.error) for f in finals] == [
            ("", reason, len(request.prompt_ids), 0, message)] * n
        assert sorted(f.index for f in finals) == list(range(n))


def test_ledger_logs_name_the_request_and_choice(caplog):
    """A dropped duplicate and an undeliverable final are logged with the request id and the
    choice (what an operator greps for)."""
    ledger = FinalLedger()
    req = GenRequest([1, 2], SamplingParams(n=2))
    ledger.open(req)
    ledger.send(req, FinalEvent("", "stop", 2, 1, index=1))
    with caplog.at_level(logging.ERROR, logger="polyserve.engine"):
        assert not ledger.send(req, FinalEvent("", "stop", 2, 1, index=1))
    assert f"duplicate final event for {req.id} choice 1 dropped" in caplog.text

    class Broken:
        def push(self, event):
            raise RuntimeError("client gone")

    other = GenRequest([1], SamplingParams(n=1))
    other.handle = Broken()  # type: ignore[assignment]
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="polyserve.engine"):
        deliver(other, FinalEvent("", "stop", 1, 1, index=0))  # logged, not raised
    assert f"could not deliver the final event of {other.id} choice 0" in caplog.text


def test_draw_follows_the_weights_and_never_draws_a_zero_weight():
    weights = torch.tensor([0.0, 1.0, 0.0, 0.5, 0.25, 0.0])
    gen = torch.Generator().manual_seed(11)
    n = 14_000
    counts = torch.bincount(torch.tensor([draw(weights, gen) for _ in range(n)]), minlength=6)
    assert counts[[0, 2, 5]].tolist() == [0, 0, 0]
    expected = weights / weights.sum() * n
    for i in (1, 3, 4):  # within 5 standard deviations of a binomial count
        sd = math.sqrt(float(expected[i]) * (1 - float(weights[i] / weights.sum())))
        assert abs(float(counts[i]) - float(expected[i])) < 5 * sd, (i, counts.tolist())


def test_draw_is_reproducible_from_the_generator():
    weights = torch.rand(1000, generator=torch.Generator().manual_seed(1))
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert [draw(weights, gen_a) for _ in range(5)] == [draw(weights, gen_b) for _ in range(5)]


def test_draw_of_a_uniform_that_rounds_up_to_the_total_takes_the_last_weighted_token(monkeypatch):
    just_below_one = torch.tensor(1.0 - 2.0**-53, dtype=torch.float64)
    monkeypatch.setattr(torch, "rand", lambda *a, **k: just_below_one)
    assert draw(torch.tensor([1.0, 0.3, 0.0, 0.0]), torch.Generator()) == 1
