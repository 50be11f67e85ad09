"""Scoring suite rows with several answers (training.evaluate.score_rows, choice_logprobs) and
in-context examples (training.icl), on the tiny random model."""

from __future__ import annotations

import pytest
import torch

from adapters_store.backbone.prompt import format_prompt, format_target
from adapters_store.lora.inject import RoutedModel
from adapters_store.lora.spec import InventorySpec
from training import evaluate
from training.data import Example
from training.evaluate import choice_logprobs, generate, score_rows
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
