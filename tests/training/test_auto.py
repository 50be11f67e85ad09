"""Demonstrations and `auto` registration (training/demos.py, training/auto.py) on the tiny model:
the demonstration budget, leave-one-out contexts that never hold an example's own answer, the
cross-validation's folds, pruning, the choice and its estimate."""

from __future__ import annotations

import pytest
import torch

from adapters_store.backbone.prompt import demonstration_token_ids, format_prompt
from training.adapt import Adaptation, AdaptResult
from training.adapt_config import AdaptConfig
from training.auto import AutoAdaptation, Candidate, folds_of
from training.data import Example
from training.demos import context_for, demonstration_text, majority_hits, select_demonstrations
from training.estimate import wilson
from training.suite import examples, parse_task

pytestmark = pytest.mark.usefixtures("one_thread")




def few(n=8, task="upper.inc", seed=0):
    return examples(parse_task(task), n, seed=seed, split="train")


def tokens(tokenizer, text):
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def test_demonstrations_fill_the_budget_from_the_first_and_skip_what_does_not_fit(tokenizer):
    exs = [Example("t", "a b", "A B"), Example("t", "x " * 200, "long"), Example("t", "c", "C")]
    one = tokens(tokenizer, demonstration_text(exs[:1]))
    both = tokens(tokenizer, demonstration_text([exs[0], exs[2]]))
    assert select_demonstrations(exs, tokenizer, one) == exs[:1]
    assert select_demonstrations(exs, tokenizer, both) == [exs[0], exs[2]]  # the long one skipped, not cut
    smallest = min(tokens(tokenizer, demonstration_text([e])) for e in exs)
    assert select_demonstrations(exs, tokenizer, smallest - 1) == []
    assert select_demonstrations(exs, tokenizer, 0) == []
    with pytest.raises(ValueError, match="budget_tokens"):
        select_demonstrations(exs, tokenizer, -1)


@pytest.mark.parametrize("backbone", ["tiny", pytest.param("default", marks=pytest.mark.slow)])
def test_demonstration_ids_are_those_the_demonstrations_get_tokenised_with_the_prompt(backbone, tokenizer):
    # training encodes demonstrations and prompt as one string (training.batching.encode_example);
    # serving tokenises the demonstrations alone (the prefix cache's ids) and then the prompt: on
    # SmolLM2's byte-level BPE the blank line alone is one token, and two before "Input"
    if backbone == "default":
        from transformers import AutoTokenizer

        from adapters_store.backbone.load import hf_dir

        tokenizer = AutoTokenizer.from_pretrained(str(hf_dir("default")))
    text = demonstration_text([Example("t", "France", "Paris"), Example("t", "cat dog 3", "3 dog cat")])
    for prompt in ("cat dog 3", "Maria drove to Lisbon.", "ünï", "a\n\nb"):
        formatted = format_prompt(prompt)
        whole = tokenizer(text + formatted).input_ids
        assert demonstration_token_ids(tokenizer, text) + tokenizer(formatted, add_special_tokens=False).input_ids \
            == whole
    alone = tokenizer(text).input_ids
    assert len(demonstration_token_ids(tokenizer, text)) >= len(alone)


def test_an_example_never_sees_its_own_answer_in_its_context():
    a, b = Example("t", "same", "A"), Example("t", "same", "A")  # one pair sent twice: two examples
    c = Example("t", "other", "C")
    demos = [a, b, c]
    assert context_for(a, demos) == demonstration_text([b, c])
    assert context_for(c, demos) == demonstration_text([a, b])
    assert context_for(Example("t", "new", "N"), demos) == demonstration_text(demos)


def test_majority_is_scored_leave_one_out():
    exs = [Example("t", str(i), o) for i, o in enumerate("aaab")]
    # each "a" against the others' majority ("a" twice, "b" once): right; "b" against "a a a": wrong
    assert majority_hits(exs) == [True, True, True, False]
    assert majority_hits([Example("t", "x", "a"), Example("t", "y", "b")]) == [False, False]


@pytest.mark.parametrize("n, folds", [(16, 4), (5, 4), (3, 4), (10, 2)])
def test_folds_cover_every_example_once(n, folds):
    parts = folds_of(n, folds, seed=3)
    assert sorted(i for p in parts for i in p) == list(range(n))
    assert len(parts) == max(2, min(folds, n))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_a_candidates_estimate_is_its_hits_with_a_wilson_interval():
    c = Candidate("routing", {i: i < 5 for i in range(8)})
    low, high = wilson(5, 8)
    assert c.estimate(8) == {"exact": 0.625, "n": 8, "low": round(low, 4), "high": round(high, 4)}
    c.stopped = True
    assert "stopped after 8 of 8" in c.estimate(8)["stopped"]


def test_demos_routing_trains_each_example_after_the_other_demonstrations(inventory, tokenizer):
    rm, info, skills = inventory
    exs = few(6)
    demos = exs[:3]
    run = Adaptation(rm, info, skills, exs, tokenizer, AdaptConfig(method="routing", steps=2, holdout_fraction=0.0),
                     demonstrations=demos)
    by_ids = {e.input_ids: e for e in run.train}
    for ex in exs:
        context = context_for(ex, demos)
        want = tuple(tokenizer(context + f"Input: {ex.input}\nOutput:").input_ids)
        assert any(ids[: len(want)] == want for ids in by_ids), ex
    while run.step():
        pass
    res = run.result()
    assert res.demonstrations == [{"input": d.input, "output": d.output} for d in demos]
    assert res.metrics["demonstrations"] == 3


def final_factory(rm, info, skills, exs, tokenizer, made):
    """Records the runs made on all the examples (the final one); folds run on fewer."""
    def make(form, examples, demos):
        if len(examples) == len(exs):
            made.append((form, list(demos)))
        else:
            assert set(examples) < set(exs) and not set(demos) - set(examples)  # a fold's own
        method = "full" if form == "full" else "routing"
        return Adaptation(rm, info, skills, examples, tokenizer, AdaptConfig(method=method, steps=2),
                          demonstrations=demos or None)
    return make


def recording_factory(make, runs):
    """`make`, each form it is asked for recorded in `runs` first."""
    def run(form, examples, demos):
        runs.append(form)
        return make(form, examples, demos)
    return run


def run_auto(auto):
    while auto.step():
        pass
    return auto.result()


def test_auto_scores_every_form_on_every_example_and_makes_the_best(inventory, tokenizer):
    rm, info, skills = inventory
    exs = few(8)
    made: list = []
    auto = AutoAdaptation(rm, info, skills, exs, tokenizer, final_factory(rm, info, skills, exs, tokenizer, made),
                          demonstration_tokens=256, seed=0, folds=2, steps=2)
    before = {k: v.clone() for k, v in rm.skill_tensors().items()}
    res = run_auto(auto)
    est = res.metrics["estimate"]
    assert set(est["candidates"]) == {"demos", "routing", "demos+routing"}  # full only from 64 examples
    for form, c in est["candidates"].items():
        assert c["n"] == 8 or "stopped" in c, form
    scores = {f: c["exact"] for f, c in est["candidates"].items() if "stopped" not in c}
    order = ("demos", "routing", "demos+routing")
    best = max(scores, key=lambda f: (scores[f], -order.index(f)))
    assert est["chosen"] == res.metrics["chosen"] == best
    assert est["majority"]["n"] == 8 and "note" in est  # 8 examples: too few for a figure alone
    assert "eval_exact" not in res.metrics  # the final run's 2-example held-out figure is not the estimate
    if best == "demos":
        assert res.kind == "demos" and res.tensors == {} and not made
    else:
        assert made == [(best, select_demonstrations(exs, tokenizer, 256) if best == "demos+routing" else [])]
    for k, v in rm.skill_tensors().items():
        assert torch.equal(v, before[k]), k


def test_a_form_that_cannot_win_stops_before_it_trains(inventory, tokenizer, monkeypatch):
    rm, info, skills = inventory
    exs = few(8)
    made: list = []
    runs: list = []
    any_run = recording_factory(final_factory(rm, info, skills, exs, tokenizer, made), runs)
    auto = AutoAdaptation(rm, info, skills, exs, tokenizer, any_run, demonstration_tokens=256, folds=2, steps=2)

    def perfect(rows, adapter, demonstrations=False):  # the demonstrations answer every example
        yield {i: True for i, _ in rows}

    monkeypatch.setattr(auto, "_score", perfect)
    res = run_auto(auto)
    assert res.kind == "demos" and res.metrics["chosen"] == "demos" and not made and not runs
    est = res.metrics["estimate"]
    assert est["candidates"]["demos"]["exact"] == 1.0
    assert all("stopped after 0 of 8" in est["candidates"][f]["stopped"] for f in ("routing", "demos+routing"))
    assert len(res.demonstrations) == len(select_demonstrations(exs, tokenizer, 256))


def test_demos_alone_is_scored_and_never_trained(inventory, tokenizer):
    rm, info, skills = inventory
    exs = few(6)
    auto = AutoAdaptation(rm, info, skills, exs, tokenizer, lambda *_: pytest.fail("demos trains nothing"),
                          demonstration_tokens=256, forms=("demos",))
    res = run_auto(auto)
    assert isinstance(res, AdaptResult) and res.kind == "demos"
    assert res.metrics["estimate"]["candidates"]["demos"]["n"] == 6


def test_without_room_for_a_demonstration_only_the_trained_forms_compete(inventory, tokenizer):
    rm, info, skills = inventory
    exs = few(4)
    auto = AutoAdaptation(rm, info, skills, exs, tokenizer, final_factory(rm, info, skills, exs, tokenizer, []),
                          demonstration_tokens=0, folds=2, steps=1)
    assert auto.forms == ("routing",)
    with pytest.raises(ValueError, match="demonstration budget"):
        AutoAdaptation(rm, info, skills, exs, tokenizer, lambda *_: None, demonstration_tokens=0, forms=("demos",))


def test_cancel_stops_auto_without_a_result(inventory, tokenizer):
    rm, info, skills = inventory
    exs = few(8)
    auto = AutoAdaptation(rm, info, skills, exs, tokenizer, final_factory(rm, info, skills, exs, tokenizer, []),
                          demonstration_tokens=256, folds=2, steps=2)
    auto.step()
    auto.cancel()
    while auto.step():
        pass
    with pytest.raises(RuntimeError, match="cancelled"):
        auto.result()


def test_after_demonstrations_an_answer_may_end_with_a_newline_token():
    from training.auto import ended_exact
    from training.loss import TargetLogits

    # two rows: "a b <end>" and "c <end>"; vocabulary 6, end token 5, a newline token 4
    targets = torch.tensor([0, 1, 5, 2, 5])
    rows = torch.tensor([0, 0, 0, 1, 1])

    def logits(pred):
        out = torch.zeros(len(pred), 6)
        out[torch.arange(len(pred)), torch.tensor(pred)] = 1.0
        return out

    def exact(pred, ends=(5, 4)):
        return ended_exact(TargetLogits(logits(pred), targets, rows, 2), torch.tensor(ends)).tolist()

    assert exact([0, 1, 5, 2, 5]) == [1.0, 1.0]
    assert exact([0, 1, 4, 2, 4]) == [1.0, 1.0]  # a newline ends the answer as the end token does
    assert exact([0, 1, 3, 2, 5]) == [0.0, 1.0]  # anything else does not
    assert exact([0, 4, 5, 2, 5]) == [0.0, 1.0]  # nor a newline inside the answer
    assert exact([0, 1, 4, 2, 4], ends=(5,)) == [0.0, 0.0]


def test_long_examples_train_after_fewer_demonstrations_and_are_scored_after_all(inventory, tokenizer):
    # a training row's context stays within TRAIN_DEMONSTRATION_TOKENS, so a step of long examples
    # costs about a routing step; held-out rows see every other demonstration, as served
    from training.adapt import TRAIN_DEMONSTRATION_TOKENS

    rm, info, skills = inventory
    def demo_tokens(n: int) -> int:
        return len(tokenizer(demonstration_text([Example("t", " ".join(["word"] * n) + " 0", "a0")])).input_ids)

    n = next(n for n in range(1, 400) if demo_tokens(n) > TRAIN_DEMONSTRATION_TOKENS * 0.4)  # two fit, three do not
    exs = [Example("t", " ".join(["word"] * n) + f" {i}", f"a{i}") for i in range(8)]
    run = Adaptation(rm, info, skills, exs, tokenizer, AdaptConfig(method="routing", steps=1, holdout_fraction=0.25),
                     demonstrations=exs)
    one = len(tokenizer(demonstration_text(exs[:1])).input_ids)
    assert 2 * one <= TRAIN_DEMONSTRATION_TOKENS < 3 * one
    for e in run.train:
        assert e.input_ids.count(tokenizer("Input:", add_special_tokens=False).input_ids[0]) == 3  # 2 + its own
    for e in run.held:
        assert e.input_ids.count(tokenizer("Input:", add_special_tokens=False).input_ids[0]) == len(exs)


def test_serve_early_hands_out_the_demonstrations_before_anything_is_scored(inventory, tokenizer):
    rm, info, skills = inventory
    exs = few(8)
    runs: list = []
    early: list = []
    any_run = recording_factory(final_factory(rm, info, skills, exs, tokenizer, []), runs)

    def on_early(result):
        early.append((result, list(runs), auto.forwards))

    auto = AutoAdaptation(rm, info, skills, exs, tokenizer, any_run, demonstration_tokens=256, folds=2, steps=1,
                          on_early=on_early)
    res = run_auto(auto)
    assert len(early) == 1
    first, trained_before, forwards_before = early[0]
    assert trained_before == [] and forwards_before == 0  # served before anything was scored or trained
    assert auto.forwards > 0 and res.metrics["chosen"] in ("demos", "routing", "demos+routing")
    assert first.kind == "demos" and first.tensors == {} and first.metrics["method"] == "demos"
    assert first.demonstrations == [{"input": d.input, "output": d.output}
                                    for d in select_demonstrations(exs, tokenizer, 256)]


def test_serve_early_without_demonstrations_hands_out_a_retrieved_row_first(inventory, tokenizer):
    from training.retrieve import Retrieval

    rm, info, skills = inventory
    exs = few(4)
    runs: list = []
    early: list = []
    others = {"other": torch.zeros(len(info.layer_names), info.spec.n_heads, info.spec.n_skills)}

    def any_run(form, examples, demos):
        runs.append((form, len(examples)))
        if form == "retrieve":
            return Retrieval(rm, info, others, examples, tokenizer, seed=0)
        return final_factory(rm, info, skills, exs, tokenizer, [])(form, examples, demos)

    auto = AutoAdaptation(rm, info, skills, exs, tokenizer, any_run, demonstration_tokens=0, folds=2, steps=1,
                          on_early=lambda r: early.append((r, list(runs))))
    run_auto(auto)
    assert len(early) == 1 and early[0][1] == [("retrieve", 4)]  # on every example, before the folds
    assert early[0][0].kind == "routing" and early[0][0].tensors["logits"].shape == others["other"].shape
    assert runs[0] == ("retrieve", 4) and all(form == "routing" for form, _ in runs[1:])
