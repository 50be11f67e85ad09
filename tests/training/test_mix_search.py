"""Gradient-free mixing of stored routing rows (training/mix_search.py), on the tiny model."""

from __future__ import annotations

import pytest
import torch

from tests.support.inventory_utils import make_inventory
from training.batching import collate, encode_all
from training.loss import target_logits, token_loss
from training.mix_search import gradient_free_mix, mixed_row
from training.routing_table import row_weights
from training.suite import examples, parse_task

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def inventory(tiny_model):
    rm, info, _ = make_inventory(tiny_model)
    return rm, info


def test_mixed_row_is_the_weighted_sum_of_rows():
    rows = torch.randn(3, 2, 1, 4)
    w = torch.tensor([0.5, -1.0, 2.0])
    torch.testing.assert_close(mixed_row(rows, w), 0.5 * rows[0] - rows[1] + 2 * rows[2])


def test_the_search_never_ends_above_mu_and_stays_within_its_budget(inventory, tokenizer):
    rm, info = inventory
    L, h, S = len(info.layer_names), 2, 4
    gen = torch.Generator().manual_seed(0)
    candidates = {f"t{i}": torch.randn(L, h, S, generator=gen) * 3 for i in range(6)}
    few = examples(parse_task("upper"), 8, seed=0, split="train")
    plan = rm.batch.plan
    res = gradient_free_mix(rm, info, candidates, few, tokenizer, seed=0, n_rows=4, budget=17, autocast=False)
    assert rm.batch.plan is plan  # the model is given back as found
    m = res.metrics
    assert m["evaluations"] == 17 and len(m["candidates"]) == 4 and set(m["candidates"]) <= set(candidates)
    assert m["objective"] <= m["mu_objective"]
    w = torch.tensor(m["weights"])
    torch.testing.assert_close(res.tensors["logits"],
                               mixed_row(torch.stack([candidates[n] for n in m["candidates"]]), w),
                               rtol=1e-3, atol=1e-3)
    # the objective it reports is the mixed row's real loss (token mean) plus the L1 penalty
    batch = collate(encode_all(tokenizer, few, 128), tokenizer.eos_token_id if tokenizer.pad_token_id is None
                    else tokenizer.pad_token_id)
    rm.set_materialized(row_weights(res.tensors["logits"], "sigmoid", train=False), rows=len(few))
    with torch.no_grad():
        loss = float(token_loss(target_logits(rm.model, batch)))
    assert m["objective"] == pytest.approx(loss + 0.05 * float(w.abs().sum()), rel=1e-3)
    if m["objective"] < m["mu_objective"]:
        assert w.abs().sum() > 0
    same = gradient_free_mix(rm, info, candidates, few, tokenizer, seed=0, n_rows=4, budget=17, autocast=False)
    assert same.metrics["weights"] == m["weights"]
