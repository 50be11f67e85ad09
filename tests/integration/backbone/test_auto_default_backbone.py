"""`auto` on the real default backbone and the shipped inventory, 16 examples each: for a task the
backbone can recall (city to country) the demonstrations win; for a word-order rewrite of made-up
words, which no prompt teaches it, a trained row wins (`make test-heavy`: it trains five times)."""

from __future__ import annotations

import pytest
import torch

from training.data import Example

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    from adapters_store.backbone.load import load_backbone
    from adapters_store.lora.inject import RoutedModel
    from adapters_store.store.directory import DirectoryStore
    from training.shipped_inventory import install_default_inventory

    torch.set_num_threads(2)
    bb = load_backbone("default")
    store = DirectoryStore(tmp_path_factory.mktemp("auto") / "store")
    install_default_inventory(store)
    info, skills = store.load_inventory(bb.fingerprint)
    rm = RoutedModel(bb.model, info.spec)
    rm.load_skills(skills)
    return bb, store, info, {k: v.float() for k, v in skills.items()}, rm


def register(shipped, exs: list[Example]):
    from training.adapt import Adaptation
    from training.adapt_config import AdaptConfig
    from training.auto import AutoAdaptation
    from training.retrieve import MAX_CANDIDATES, Retrieval, RetrievedAdaptation

    bb, store, info, skills, rm = shipped
    rows = store.routing_rows(limit=MAX_CANDIDATES)

    def run(form, examples, demos):  # as server/jobs/adaptation.py makes each form
        config = AdaptConfig(method="routing", seed=0)
        if form == "routing":
            retrieval = Retrieval(rm, info, rows, examples, bb.tokenizer, seed=0)
            return RetrievedAdaptation(retrieval, lambda row, known: Adaptation(
                rm, info, skills, examples, bb.tokenizer, config, init_row=row, init_eval=known))
        return Adaptation(rm, info, skills, examples, bb.tokenizer, config, demonstrations=demos)

    auto = AutoAdaptation(rm, info, skills, exs, bb.tokenizer, run, demonstration_tokens=1024, seed=0)
    while auto.step():
        pass
    return auto.result()


def test_a_recall_task_is_served_as_its_demonstrations(shipped):
    from training.real_tasks import real_task_examples

    few, _ = real_task_examples("city-country", 16, seed=0)
    res = register(shipped, few)
    est = res.metrics["estimate"]
    assert res.kind == "demos" and est["chosen"] == "demos", est
    assert est["candidates"]["demos"]["exact"] >= 0.75 and len(res.demonstrations) == 16
    assert est["majority"]["exact"] < est["candidates"]["demos"]["exact"]


@pytest.mark.heavy  # five trainings (two forms x two folds, then the chosen one): minutes on 2 cores
def test_a_word_order_rewrite_of_made_up_words_gets_a_trained_row(shipped):
    from training.suite import examples, parse_task

    few = examples(parse_task("swap-ends"), 16, seed=1000, split="valid", vocab="madeup")
    res = register(shipped, few)
    est = res.metrics["estimate"]
    assert res.kind == "routing" and est["chosen"] in ("routing", "demos+routing"), est
    chosen = est["candidates"][est["chosen"]]["exact"]
    assert chosen > est["candidates"]["demos"]["exact"] and chosen >= 0.5, est
