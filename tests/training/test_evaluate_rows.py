"""Scoring suite rows with several answers (training.evaluate.score_rows, choice_logprobs) and
in-context examples (training.icl), on the tiny random model."""

from __future__ import annotations

import pytest
import torch

from adapters_store.backbone.prompt import format_prompt, format_target
from adapters_store.lora.combine import materialize
from adapters_store.lora.inject import RoutedModel
from adapters_store.lora.spec import InventorySpec
from tests.support.server_fixtures import random_skills
from training import evaluate
from training.batching import IGNORE, Encoded
from training.data import Example
from training.evaluate import choice_logprobs, generate, score_rows, shared_prompt
from training.icl import icl_context

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def rm(tiny_model):
    return RoutedModel(tiny_model, InventorySpec(n_skills=2, n_heads=1, rank=2))


def test_choice_logprobs_are_the_summed_token_logprobs_of_each_choice(rm, tokenizer):
    question, choices = "cat 3", ["dog", "bird 4"]
    got = choice_logprobs(rm, None, tokenizer, question, choices)
    for choice, lp in zip(choices, got, strict=True):
        prompt = tokenizer(format_prompt(question)).input_ids
        answer = tokenizer(format_target(choice), add_special_tokens=False).input_ids
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():
            logp = torch.log_softmax(rm.model(input_ids=ids).logits[0].float(), -1)
        want = sum(float(logp[len(prompt) - 1 + i, tok]) for i, tok in enumerate(answer))
        assert lp == pytest.approx(want, abs=1e-4)


def test_score_rows_counts_any_target_and_ranks_choices(rm, tokenizer, monkeypatch):
    rows = [{"input": "a 1", "output": "x", "targets": ["x", "y"]},
            {"input": "b 2", "output": "y", "targets": ["y"]},
            {"input": "c 3", "output": "p", "choices": ["p", "q"]}]
    monkeypatch.setattr(evaluate, "generate", lambda _rm, _ad, _tok, inputs, *a, **k: ["y", "z", "q"][: len(inputs)])
    # (the first answer matches its second target)
    monkeypatch.setattr(evaluate, "choice_logprobs", lambda *a, **k: [-1.0, -2.0])
    out = score_rows(rm, None, tokenizer, rows)
    assert out["exact_match"] == pytest.approx(1 / 3) and out["ll_acc"] == 1.0 and out["loss"] > 0
    monkeypatch.setattr(evaluate, "choice_logprobs", lambda *a, **k: [-3.0, -2.0])
    assert score_rows(rm, None, tokenizer, rows)["ll_acc"] == 0.0
    assert "ll_acc" not in score_rows(rm, None, tokenizer, rows[:2])


def test_a_context_goes_before_every_prompt(rm, tokenizer):
    demos = [Example("t", "cat 3", "CAT 3"), Example("t", "dog 4", "DOG 4")]
    ctx = icl_context(demos)
    assert ctx == "Input: cat 3\nOutput: CAT 3\n\nInput: dog 4\nOutput: DOG 4\n\n"
    with_ctx = generate(rm, None, tokenizer, ["sun 5"], 4, context=ctx, max_length=512)
    ids = torch.tensor([tokenizer(ctx + format_prompt("sun 5")).input_ids])
    with torch.no_grad():
        out = rm.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                                pad_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    assert with_ctx == [tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)]


def _unshared(monkeypatch, *args, **kwargs):
    """choice_logprobs with every choice run on its whole prompt (no cache shared)."""
    with monkeypatch.context() as m:
        m.setattr(evaluate, "shared_prompt", lambda rows: 0)
        return choice_logprobs(*args, **kwargs)


@pytest.mark.parametrize("adapter", ["bare", "mixed", "lora"])
def test_choices_on_the_prompts_shared_cache_score_as_each_on_its_whole_prompt(tiny_model, tokenizer, monkeypatch,
                                                                               adapter):
    rm = random_skills(tiny_model, InventorySpec(n_skills=2, n_heads=1, rank=2))
    weights = torch.softmax(torch.randn(len(rm.layers), 1, 2, generator=torch.Generator().manual_seed(3)), -1)
    as_lora = [materialize(layer.lora_A.detach(), layer.lora_B.detach(), weights[i])
               for i, layer in enumerate(rm.layers)]
    chosen = {"bare": None, "mixed": weights, "lora": as_lora}[adapter]
    ctx = icl_context([Example("t", "cat 3", "CAT 3")])
    choices = ["dog", "bird 4", "a much longer choice 5 6 7", "x"] * 2  # more than one copy of the cache
    monkeypatch.setattr(evaluate, "CHOICE_BATCH", 3)
    got = choice_logprobs(rm, chosen, tokenizer, "sun 5", choices, ctx)
    want = _unshared(monkeypatch, rm, chosen, tokenizer, "sun 5", choices, ctx)
    assert got == pytest.approx(want, abs=1e-4)
    assert got[:4] == pytest.approx(got[4:], abs=1e-4)  # a choice scores the same in another chunk
    assert min(abs(a - b) for i, a in enumerate(got[:4]) for b in got[i + 1:4]) > 1e-3  # the choices differ


def test_only_the_common_prompt_short_of_its_last_token_is_shared(monkeypatch):
    monkeypatch.setattr(evaluate, "MIN_SHARED", 1)

    def enc(prompt, answer):
        return Encoded(tuple(prompt + answer), tuple([IGNORE] * len(prompt) + answer))
    assert shared_prompt([enc([1, 2, 3, 4], [7]), enc([1, 2, 3, 4], [8, 9])]) == 3  # 4's logit scores the answer
    assert shared_prompt([enc([1, 2, 3, 4], [7]), enc([2, 3, 4], [8])]) == 0  # a prompt cut on its left
    assert shared_prompt([enc([1, 2, 5, 4], [7]), enc([1, 2, 3, 4], [8])]) == 2
    assert shared_prompt([enc([1, 2, 3, 4], [7])]) == 0  # nothing to share with
    assert shared_prompt([enc([1], [7]), enc([1], [8])]) == 0
    monkeypatch.setattr(evaluate, "MIN_SHARED", 4)
    assert shared_prompt([enc([1, 2, 3, 4], [7]), enc([1, 2, 3, 4], [8, 9])]) == 0  # 3 tokens: not worth it
    assert shared_prompt([enc([1, 2, 3, 4, 5], [7]), enc([1, 2, 3, 4, 5], [8])]) == 4


def _sharp_with_context(tiny_model, adapter, seed):
    """The tiny model with sharp attention (a token's position then moves the answers and scores),
    routed by a small random mix or bare, and a context of two demonstrations."""
    with torch.no_grad():
        for layer in tiny_model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
    rm = random_skills(tiny_model, InventorySpec(n_skills=2, n_heads=1, rank=2))
    weights = torch.softmax(torch.randn(len(rm.layers), 1, 2, generator=torch.Generator().manual_seed(seed)), -1)
    chosen = None if adapter == "bare" else weights * 0.05  # a small routed delta: answers still differ
    return rm, chosen, icl_context([Example("t", "cat 3", "CAT 3"), Example("t", "dog 4 bird", "DOG 4 BIRD")])


@pytest.mark.parametrize("adapter", ["bare", "mixed"])
def test_prompts_after_a_shared_context_generate_and_score_as_each_on_its_whole_prompt(tiny_model, tokenizer,
                                                                                        monkeypatch, adapter):
    rm, chosen, ctx = _sharp_with_context(tiny_model, adapter, seed=5)
    examples = [Example("t", text, out) for text, out in
                [("sun 5", "SUN 5"), ("a much longer input 6 7 8", "A"), ("x", "X Y"), ("moon 9 cat", "MOON")]]
    inputs = [ex.input for ex in examples]
    got = generate(rm, chosen, tokenizer, inputs, 6, batch_size=3, context=ctx, max_length=512)
    loss = evaluate.heldout_loss(rm, chosen, tokenizer, examples, batch_size=3, max_length=512, context=ctx)
    prefix = evaluate.context_prefix(rm, chosen, tokenizer, inputs, ctx, 512)
    assert prefix is not None
    after = generate(rm, chosen, tokenizer, inputs, 6, batch_size=3, context=ctx, max_length=512, prefix=prefix)
    loss_after = evaluate.heldout_loss(rm, chosen, tokenizer, examples, batch_size=3, max_length=512, context=ctx,
                                       prefix=prefix)
    with monkeypatch.context() as m:
        m.setattr(evaluate, "shared_prompt", lambda rows: 0)
        want = generate(rm, chosen, tokenizer, inputs, 6, batch_size=3, context=ctx, max_length=512)
        want_loss = evaluate.heldout_loss(rm, chosen, tokenizer, examples, batch_size=3, max_length=512, context=ctx)
    assert got == want == after and len(set(want)) > 1
    assert loss == pytest.approx(want_loss, abs=1e-4) and loss_after == pytest.approx(want_loss, abs=1e-4)


@pytest.mark.parametrize("adapter", ["bare", "mixed"])
def test_questions_after_the_contexts_cache_score_as_each_on_its_whole_prompt(tiny_model, tokenizer, adapter):
    rm, chosen, ctx = _sharp_with_context(tiny_model, adapter, seed=7)
    rows = [{"input": q, "output": c[0], "choices": c} for q, c in
            [("sun 5", ["SUN 5", "sun", "MOON 5"]), ("a much longer input 6 7 8", ["A", "B C"]), ("x", ["X Y", "X"])]]
    prefix = evaluate.context_prefix(rm, chosen, tokenizer, [r["input"] for r in rows], ctx, 512)
    assert prefix is not None and len(prefix.ids) >= len(tokenizer(ctx).input_ids) - 1
    for r in rows:  # each question in turn: the context's cache is not extended by the one before
        got = choice_logprobs(rm, chosen, tokenizer, r["input"], r["choices"], ctx, 512, prefix)
        want = choice_logprobs(rm, chosen, tokenizer, r["input"], r["choices"], ctx, 512)
        assert got == pytest.approx(want, abs=1e-4)
    other = evaluate.context_prefix(rm, chosen, tokenizer, [r["input"] for r in rows],
                                    icl_context([Example("t", "b", "B")] * 3), 512)
    assert other is not None  # a prefix the prompt does not begin with is not used
    assert choice_logprobs(rm, chosen, tokenizer, "x", ["X Y", "X"], ctx, 512, other) == pytest.approx(
        choice_logprobs(rm, chosen, tokenizer, "x", ["X Y", "X"], ctx, 512), abs=1e-4)
    assert evaluate.context_prefix(rm, chosen, tokenizer, [r["input"] for r in rows], "", 512) is None


def test_score_rows_runs_the_context_once_for_generation_choices_and_loss(rm, tokenizer, monkeypatch):
    rows = [{"input": "c 3", "output": "p", "choices": ["p", "q"]},
            {"input": "d 4", "output": "q", "choices": ["p", "q"]}]
    ctx = icl_context([Example("t", "cat 3", "CAT 3"), Example("t", "dog 4", "DOG 4")])
    context_ids = tokenizer(ctx).input_ids
    whole, real = [], evaluate.prompt_cache

    def counted(rm_, adapter, ids, past=None):
        if past is None and len(ids) >= len(context_ids) - 1:  # the context run from its first token
            whole.append(len(ids))
        return real(rm_, adapter, ids, past)

    monkeypatch.setattr(evaluate, "prompt_cache", counted)
    seen = []
    real_choices = evaluate.choice_logprobs
    monkeypatch.setattr(evaluate, "choice_logprobs", lambda *a, **k: seen.append(a[7]) or real_choices(*a, **k))
    score_rows(rm, None, tokenizer, rows, context=ctx, max_length=512)
    assert len(seen) == 2 and seen[0] is seen[1] and isinstance(seen[0], evaluate.Prefix)
    assert len(whole) == 1  # generation, the two questions' choices and the loss all continue from it


def test_greedy_after_a_cache_stops_each_row_at_its_eos(tiny_model, tokenizer, monkeypatch):
    rm = RoutedModel(tiny_model, InventorySpec(n_skills=2, n_heads=1, rank=2))
    prompt = tokenizer(format_prompt("sun 5")).input_ids
    cache = evaluate.prompt_cache(rm, None, prompt[:3])
    free = evaluate.greedy_after(rm.model, evaluate.copies(cache, 1), [prompt[3:]], 5, pad=0, eos=-1)[0]
    assert len(free) == 5
    stop = free[1]  # the second token, taken as eos: the row ends with it, the others go on
    rows = evaluate.greedy_after(rm.model, evaluate.copies(cache, 2), [prompt[3:], prompt[4:]], 5, pad=0, eos=stop)
    assert rows[0] == free[: free.index(stop) + 1]
