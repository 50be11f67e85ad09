"""Retrieval of a routing row from existing tasks' rows (training.retrieve): the math, that it
finds the task the examples come from, that it borrows the shared model and gives it back, its
slicing, and that routing training starts from what it retrieved."""

from __future__ import annotations

import pytest
import torch

from adapters_store.lora.routing import eval_weights
from tests.support.inventory_utils import make_inventory
from training.adapt import Adaptation, adapt
from training.adapt_config import AdaptConfig
from training.retrieve import MU, Retrieval, RetrievedAdaptation, mixture, mu_row, predicted_change, retrieve
from training.suite import examples, parse_task

pytestmark = pytest.mark.usefixtures("one_thread")




@pytest.fixture
def inventory(tiny_model):
    return make_inventory(tiny_model)


def few(task, n=16, seed=0):
    return examples(parse_task(task), n, seed=seed, split="train")


@pytest.fixture
def library(inventory, tokenizer):
    """Rows learned on two tasks, plus two rows pushed hard to random corners."""
    rm, info, skills = inventory
    config = AdaptConfig(steps=40, lr=0.3, seed=0)
    rows = {name: adapt(rm, info, skills, few(name, seed=1), tokenizer, config).tensors["logits"]
            for name in ("upper", "rev-words")}
    gen = torch.Generator().manual_seed(5)
    L, h, S = len(info.layer_names), info.spec.n_heads, info.spec.n_skills
    for i in range(2):
        rows[f"noise{i}"] = torch.randn(L, h, S, generator=gen) * 6
    return rows


# -- pure pieces ---------------------------------------------------------------------------------
def test_mu_row_gives_uniform_weights():
    assert torch.allclose(eval_weights(mu_row(3, 2, 4, hyper=False)), torch.full((3, 2, 4), 0.25))
    assert torch.equal(mu_row(3, 2, 4, hyper=True), torch.full((3, 2, 4), 0.25))


def test_mixture_is_the_mean_of_rows():
    rows = torch.stack([torch.zeros(2, 1, 3), torch.ones(2, 1, 3) * 4])
    assert torch.equal(mixture(rows), torch.full((2, 1, 3), 2.0))
    assert torch.equal(mixture(rows[:1]), rows[0])


def test_predicted_change_is_the_first_order_term():
    grad = torch.tensor([[[1.0, -2.0]]])
    mu = torch.tensor([[[0.5, 0.5]]])
    weights = torch.tensor([[[[1.0, 0.0]]], [[[0.0, 1.0]]], [[[0.5, 0.5]]]])
    assert torch.allclose(predicted_change(grad, weights, mu), torch.tensor([1.5, -1.5, 0.0]))


def test_predicted_change_ranks_like_the_true_loss_for_small_moves(inventory, tokenizer):
    """The screen's premise: near μ the first-order prediction orders candidates as the loss does."""
    rm, info, _ = inventory
    exs = few("upper")
    probe = Retrieval(rm, info, {}, exs, tokenizer, holdout_fraction=0.0)
    gen = torch.Generator().manual_seed(0)
    L, h, S = len(info.layer_names), info.spec.n_heads, info.spec.n_skills
    small = {f"c{i}": torch.randn(L, h, S, generator=gen) * 0.3 for i in range(4)}
    job = Retrieval(rm, info, small, exs, tokenizer, holdout_fraction=0.0, ks=(1,))
    while job.stage == "screen":
        job.step()
    true = {}
    for name, row in small.items():
        single = Retrieval(rm, info, {}, exs, tokenizer, holdout_fraction=0.0)
        single.choices = {MU: row}
        while single.step():
            pass
        true[name] = single.held_loss[MU]
    assert probe  # built without candidates: nothing to screen
    by_prediction = [job.names[i] for i in job.ranked]
    assert by_prediction[0] == min(true, key=true.get)
    assert by_prediction[-1] == max(true, key=true.get)


# -- retrieval ------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["upper", "rev-words"])
def test_retrieval_finds_the_task_the_examples_come_from(inventory, tokenizer, library, source):
    rm, info, _ = inventory
    res = retrieve(rm, info, library, few(source, seed=7), tokenizer, seed=0)
    m = res.metrics
    assert m["ranked"][0] == source, m
    assert m["k"] >= 1 and m["retrieved"][0] == source
    assert m["eval_loss"] < m["mu_eval_loss"], m
    assert res.kind == "routing" and res.tensors["logits"].shape == library[source].shape
    assert m["candidates"] == 4 and m["n_train"] + m["n_held"] == 16


def test_the_chosen_row_is_the_best_of_the_choices_on_held_out_examples(inventory, tokenizer, library):
    rm, info, _ = inventory
    job = Retrieval(rm, info, library, few("upper", seed=7), tokenizer, ks=(1, 2, 4))
    while job.step():
        pass
    res = job.result()
    assert set(job.held_loss) == {MU, "top1", "top2", "top4"}
    assert res.metrics["eval_loss"] == min(job.held_loss.values())
    k = res.metrics["k"]
    expected = job.rows[job.ranked[:k]].mean(0) if k else job.mu
    assert torch.equal(res.tensors["logits"], expected)


def test_without_candidates_retrieval_is_mu(inventory, tokenizer):
    rm, info, _ = inventory
    res = retrieve(rm, info, {}, few("upper"), tokenizer)
    assert res.metrics["k"] == 0 and res.metrics["retrieved"] == []
    assert torch.equal(res.tensors["logits"], mu_row(len(info.layer_names), 2, 4, hyper=False))


def test_retrieval_borrows_the_model_and_gives_it_back(inventory, tokenizer, library):
    rm, info, _ = inventory
    plan_weights = torch.randn(len(rm.layers), 1, 2, 4)
    rm.set_weights(plan_weights)
    plan = rm.batch.plan
    flags = [p.requires_grad for p in rm.skill_parameters()]
    before = {k: v.clone() for k, v in rm.skill_tensors().items()}
    job = Retrieval(rm, info, library, few("upper"), tokenizer, rows_per_step=8)
    while job.step():
        assert rm.batch.plan is plan
        assert [p.requires_grad for p in rm.skill_parameters()] == flags
    for k, v in rm.skill_tensors().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in rm.skill_parameters())


def test_every_step_is_one_forward_of_at_most_rows_per_step_rows(inventory, tokenizer, library):
    rm, info, _ = inventory
    seen: list[int] = []
    hook = rm.model.get_decoder().register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        job = Retrieval(rm, info, library, few("upper", n=40), tokenizer, rows_per_step=8, screen_tokens=0)
        steps = 0
        while True:
            before = len(seen)
            more = job.step()
            steps += 1
            assert len(seen) - before == 1
            if not more:
                break
    finally:
        hook.remove()
    assert max(seen) <= 8
    assert steps == job.forwards == job.total_forwards  # progress knows the total up front
    assert sum(seen) == 30 + 10 * 4  # the screen on 30 training examples; 4 choices x 10 held out


def test_hyper_routing_mu_stays_put(tiny_model, tokenizer):
    """hyper rows are the weights themselves: the screen's gradient leaf must be a copy of μ."""
    rm, info, _ = make_inventory(tiny_model, routing="hyper")
    gen = torch.Generator().manual_seed(0)
    rows = {f"c{i}": torch.rand(len(info.layer_names), 2, 4, generator=gen) for i in range(3)}
    first = retrieve(rm, info, rows, few("upper", n=20), tokenizer, rows_per_step=4)
    job = Retrieval(rm, info, rows, few("upper", n=20), tokenizer, rows_per_step=4)
    while job.step():
        pass
    assert torch.equal(job.mu, torch.full_like(job.mu, 0.25)) and not job.mu.requires_grad
    assert torch.equal(job.result().tensors["logits"], first.tensors["logits"])


def test_cancel_stops_and_leaves_no_result(inventory, tokenizer, library):
    rm, info, _ = inventory
    job = Retrieval(rm, info, library, few("upper"), tokenizer, rows_per_step=4)
    assert job.step()
    job.cancel()
    assert job.step() is False
    with pytest.raises(RuntimeError, match="cancelled"):
        job.result()


def test_bad_candidates_are_refused(inventory, tokenizer):
    rm, info, _ = inventory
    with pytest.raises(ValueError, match="shape"):
        Retrieval(rm, info, {"bad": torch.zeros(1, 2, 3)}, few("upper"), tokenizer)
    with pytest.raises(ValueError, match="at least one example"):
        Retrieval(rm, info, {}, [], tokenizer)


# -- retrieval-initialised training ---------------------------------------------------------------
@pytest.mark.parametrize("select", ["loss", "exact"])
def test_routing_training_starts_from_the_retrieved_row(inventory, tokenizer, library, select):
    rm, info, skills = inventory
    exs = few("upper", seed=7)
    config = AdaptConfig(steps=5, seed=0, select=select)
    staged = RetrievedAdaptation(
        Retrieval(rm, info, library, exs, tokenizer, seed=0),
        lambda row, known: Adaptation(rm, info, skills, exs, tokenizer, config, init_row=row, init_eval=known),
    )
    known = None
    while staged.step():
        if known is None and staged.adaptation is not None:
            known = staged.retrieval.known_eval()
            assert known is not None and known.exact == staged.retrieval.held_exact[staged.retrieval.chosen]
            # the known evaluation is its first, not run again
            assert staged.adaptation.evals == 1 and staged.adaptation.best_exact == known.exact
    res = staged.result()
    retrieved = staged.retrieved.metrics
    assert retrieved["k"] >= 1
    # same held-out split: the retrieval's loss of its row is the initial one, not measured again
    assert res.metrics["initial_eval_loss"] == retrieved["eval_loss"] and staged.adaptation.evals == 2
    assert res.metrics["initial_eval_loss"] < retrieved["mu_eval_loss"]
    assert res.metrics["init"] == "retrieve" and res.metrics["retrieved"] == retrieved["retrieved"]


def test_init_row_is_validated(inventory, tokenizer):
    rm, info, skills = inventory
    with pytest.raises(ValueError, match="init_row"):
        Adaptation(rm, info, skills, few("upper"), tokenizer, AdaptConfig(method="mu"), init_row=torch.zeros(2, 2, 4))


def test_the_screen_takes_as_many_training_examples_as_screen_tokens_hold(inventory, tokenizer, library):
    """Long examples screen a few (the choice still scores every held-out one); short ones all."""
    from training.batching import within_tokens
    from training.data import Example
    from training.retrieve import SCREEN_TOKENS

    rm, info, _ = inventory
    seen: list[tuple[int, int]] = []
    hook = rm.model.get_decoder().register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    long = [Example("t", "word " * 30 + str(i), str(i)) for i in range(16)]  # ~150 tokens of the byte tokenizer
    try:
        job = Retrieval(rm, info, library, long, tokenizer, screen_tokens=512)
        job.step()
        (n, t), = seen
        assert n == within_tokens([t] * 12, 512) == 3 and job.n_train == 12
        while job.step():
            pass
        assert job.result().metrics["n_screened"] == 3
        assert sum(r for r, _ in seen[1:]) == 4 * 4  # every choice on all 4 held-out examples
        seen.clear()
        Retrieval(rm, info, library, few("upper"), tokenizer).step()
        assert seen[0][0] == 12 and seen[0][0] * seen[0][1] <= SCREEN_TOKENS  # the suite's: all 12
        seen.clear()
        Retrieval(rm, info, library, long, tokenizer, screen_tokens=0).step()
        assert seen[0][0] == 12  # 0: no cap
    finally:
        hook.remove()
    with pytest.raises(ValueError, match=r"screen_tokens must be >= 0"):
        Retrieval(rm, info, library, long, tokenizer, screen_tokens=-1)


def test_a_held_out_estimate_comes_with_its_n_and_interval(inventory, tokenizer, library):
    rm, info, skills = inventory
    exs = few("upper", seed=7)  # 16 examples: 4 held out, below the floor
    res = retrieve(rm, info, library, exs, tokenizer)
    m = res.metrics
    assert m["n_held"] == 4 and m["eval_exact_n"] == 4 and m["eval_exact"] is not None
    assert m["eval_exact_low"] <= m["eval_exact"] <= m["eval_exact_high"]
    assert m["eval_note"].startswith("too few held-out examples")
    trained = adapt(rm, info, skills, exs, tokenizer, AdaptConfig(steps=3, seed=0)).metrics
    assert trained["eval_exact_n"] == trained["n_held"] == 4 and "too few" in trained["eval_note"]


def test_init_says_mu_where_nothing_was_retrieved(inventory, tokenizer):
    """No candidate (or none better than μ): `retrieved` is empty, and init no longer says retrieve."""
    rm, info, skills = inventory
    exs = few("upper", seed=7)
    alone = retrieve(rm, info, {}, exs, tokenizer)
    assert alone.metrics["retrieved"] == [] and "no other task" in alone.metrics["retrieve_note"]
    staged = RetrievedAdaptation(
        Retrieval(rm, info, {}, exs, tokenizer, seed=0),
        lambda row, known: Adaptation(rm, info, skills, exs, tokenizer, AdaptConfig(steps=2, seed=0),
                                      init_row=row, init_eval=known),
    )
    while staged.step():
        pass
    m = staged.result().metrics
    assert m["retrieved"] == [] and m["init"] == "mu" and "no other task" in m["init_note"]


def test_init_says_mu_where_training_did_not_start_from_the_row(inventory, tokenizer, library):
    """serve_early with method mu: the retrieved row is served first, but mu trains from the skills."""
    rm, info, skills = inventory
    exs = few("upper", seed=7)
    staged = RetrievedAdaptation(
        Retrieval(rm, info, library, exs, tokenizer, seed=0),
        lambda row, known: Adaptation(rm, info, skills, exs, tokenizer, AdaptConfig(method="mu", steps=2, seed=0)),
    )
    while staged.step():
        pass
    m = staged.result().metrics
    assert m["retrieved"] and m["init"] == "mu" and "served early" in m["init_note"]
