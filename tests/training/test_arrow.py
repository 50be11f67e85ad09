"""Arrow routing (training.arrow): prototypes against a dense SVD, per-token routing weights, the
mixture's delta against each skill's own delta, μ when the skills are identical, and the model's
plan and layers put back after use (also after an exception)."""

from __future__ import annotations

import math

import pytest
import torch

from adapters_store.lora.combine import materialize_many
from adapters_store.lora.inject import RoutedModel
from adapters_store.store.materialize import mu_weights
from tests.support.inventory_utils import make_inventory
from training.arrow import (
    ArrowConfig,
    arrow_delta,
    arrow_plan,
    arrow_routing,
    arrow_score_rows,
    arrow_weights,
    skill_prototypes,
)
from training.evaluate import score_rows
from training.suite import examples, parse_task

pytestmark = pytest.mark.usefixtures("one_thread")

N_SKILLS, N_HEADS, RANK = 4, 2, 4


@pytest.fixture
def inventory(tiny_model):
    """A RoutedModel (MHR, h = 2) whose skills all differ (B != 0)."""
    rm, info, _ = make_inventory(tiny_model, b_std=0.3, n_skills=N_SKILLS, n_heads=N_HEADS, rank=RANK)
    return rm, info


def skill_lora(A: torch.Tensor, B: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Skill s as the plain LoRA a routing row with every head on s materialises: (d_in, r), (r, d_out)."""
    onehot = torch.zeros(1, A.shape[0], A.shape[1])
    onehot[:, :, s] = 1.0
    A_s, B_s = materialize_many(A.double(), B.double(), onehot.double())
    return A_s[0], B_s[0]


def dense_rows(A: torch.Tensor, B: torch.Tensor, s: int, k: int) -> torch.Tensor:
    """Head k's input rows of skill s's dense ΔW_s = A_s @ B_s: (d_in/h, d_out)."""
    A_s, B_s = skill_lora(A, B, s)
    d_in_h = A.shape[2]
    return (A_s @ B_s)[k * d_in_h:(k + 1) * d_in_h]


def dense_prototype(A: torch.Tensor, B: torch.Tensor, s: int, k: int) -> torch.Tensor:
    """The top right singular vector of nn.Linear's view (d_out, d_in/h) of that block."""
    _, _, Vh = torch.linalg.svd(dense_rows(A, B, s, k).T)
    return Vh[0]


def test_prototypes_are_the_top_right_singular_vectors_of_each_skills_head_block(inventory):
    rm, _ = inventory
    for layer in rm.layers:
        A, B = layer.lora_A.detach(), layer.lora_B.detach()
        protos = skill_prototypes(A, B)
        assert protos.shape == (N_HEADS, N_SKILLS, A.shape[2])
        for k in range(N_HEADS):
            for s in range(N_SKILLS):
                cos = torch.dot(protos[k, s].double(), dense_prototype(A, B, s, k)).abs()  # up to sign
                assert cos == pytest.approx(1.0, abs=1e-5), (k, s)


def test_routing_weights_are_a_softmax_over_each_tokens_top_k_skills_and_sum_to_one():
    gen = torch.Generator().manual_seed(0)
    h, S, d = 2, 5, 6
    protos = torch.nn.functional.normalize(torch.randn(h, S, d, generator=gen), dim=-1)
    x = torch.randn(7, h * d, generator=gen)
    top_k, temperature = 3, 0.7
    w = arrow_weights(x, protos, top_k, temperature)  # (h, M, S)
    assert w.shape == (h, 7, S)
    torch.testing.assert_close(w.sum(-1), torch.ones(h, 7))
    logits = torch.einsum("mkd,ksd->kms", x.view(7, h, d), protos).abs()
    for k in range(h):
        for m in range(7):
            kept = logits[k, m].topk(top_k).indices
            assert set(w[k, m].nonzero().flatten().tolist()) == set(kept.tolist())
            expected = torch.softmax(logits[k, m, kept] / temperature, dim=0)
            torch.testing.assert_close(w[k, m, kept], expected)


def test_the_sign_of_a_token_does_not_change_its_routing():
    gen = torch.Generator().manual_seed(2)
    protos = torch.nn.functional.normalize(torch.randn(1, 4, 8, generator=gen), dim=-1)
    x = torch.randn(5, 8, generator=gen)
    torch.testing.assert_close(arrow_weights(x, protos, 2, 1.0), arrow_weights(-x, protos, 2, 1.0))


def test_top_1_with_one_dominant_skill_gives_that_skills_own_delta(inventory):
    rm, _ = inventory
    layer = rm.layers[0]
    A, B, scale = layer.lora_A.detach(), layer.lora_B.detach(), layer.scale
    d_in_h = A.shape[2]
    gen = torch.Generator().manual_seed(3)
    # token m's head k leans on skill chosen[m][k]: its input block is that skill's prototype plus noise;
    # the first S tokens lean on one skill in every head, the others on a different skill per head
    chosen = [[m] * N_HEADS for m in range(N_SKILLS)] + [[(m + k) % N_SKILLS for k in range(N_HEADS)]
                                                         for m in range(N_SKILLS)]
    x = torch.stack([
        torch.cat([5 * dense_prototype(A, B, s, k).float() + 0.01 * torch.randn(d_in_h, generator=gen)
                   for k, s in enumerate(skills)])
        for skills in chosen
    ])
    protos = skill_prototypes(A, B)
    w = arrow_weights(x, protos, top_k=1, temperature=1.0)
    for m, skills in enumerate(chosen):
        for k, s in enumerate(skills):
            assert w[k, m, s] == 1.0 and w[k, m].sum() == 1.0
    got = arrow_delta(x, A, B, scale, protos, top_k=1, temperature=1.0)
    for m, skills in enumerate(chosen[:N_SKILLS]):  # that skill's whole LoRA
        A_s, B_s = skill_lora(A, B, skills[0])
        torch.testing.assert_close(got[m].double(), x[m].double() @ A_s @ B_s * scale, rtol=1e-4, atol=1e-6)
    for m, skills in list(enumerate(chosen))[N_SKILLS:]:  # each head's block through its own skill
        want = sum(x[m].double().view(N_HEADS, d_in_h)[k] @ dense_rows(A, B, s, k) for k, s in enumerate(skills))
        torch.testing.assert_close(got[m].double(), want * scale, rtol=1e-4, atol=1e-6)


def test_the_delta_is_the_routed_mixture_of_each_skills_output(inventory):
    """Any top_k: delta = sum_k sum_s w[k, s] x_k ΔW_s[rows k] scale, against a loop over dense blocks."""
    rm, _ = inventory
    layer = rm.layers[-1]
    A, B, scale = layer.lora_A.detach(), layer.lora_B.detach(), layer.scale
    x = torch.randn(3, 5, A.shape[0] * A.shape[2], generator=torch.Generator().manual_seed(4))
    protos = skill_prototypes(A, B)
    got = arrow_delta(x, A, B, scale, protos, top_k=2, temperature=0.5)
    flat = x.reshape(-1, x.shape[-1]).double()
    w = arrow_weights(flat.float(), protos, 2, 0.5).double()
    d_in_h = A.shape[2]
    want = sum(w[k, :, s, None] * (flat[:, k * d_in_h:(k + 1) * d_in_h] @ dense_rows(A, B, s, k)) * scale
               for k in range(N_HEADS) for s in range(N_SKILLS))
    torch.testing.assert_close(got.double(), want.view(3, 5, -1), rtol=1e-4, atol=1e-6)
    plan = arrow_plan(rm, top_k=2, temperature=0.5)
    torch.testing.assert_close(plan.delta(len(rm.layers) - 1, x), got)


def make_skills_identical(rm: RoutedModel) -> None:
    """Every skill of every head becomes a copy of skill 0."""
    with torch.no_grad():
        for layer in rm.layers:
            layer.lora_A.copy_(layer.lora_A[:, :1].clone().expand_as(layer.lora_A))
            layer.lora_B.copy_(layer.lora_B[:, :1].clone().expand_as(layer.lora_B))


def ids(tokenizer):
    return tokenizer(["hello world", "abc def"], return_tensors="pt", padding=True).input_ids


@torch.no_grad()
def test_identical_skills_give_mus_output(inventory, tokenizer):
    rm, info = inventory
    make_skills_identical(rm)
    x = ids(tokenizer)
    rm.set_materialized(mu_weights(info), rows=x.shape[0])
    mu = rm.model(x).logits
    rm.set_weights(None)
    bare = rm.model(x).logits
    assert not torch.allclose(mu, bare, atol=1e-4)  # the skills do change the output
    for top_k in (1, 2, None):
        rm.batch.set(arrow_plan(rm, top_k=top_k))
        torch.testing.assert_close(rm.model(x).logits, mu, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_distinct_skills_route_away_from_mu_and_the_pinned_plan_is_the_plain_plan(inventory, tokenizer):
    rm, info = inventory
    x = ids(tokenizer)
    plan = arrow_plan(rm, top_k=2)
    rm.batch.set(plan)
    routed = rm.model(x).logits
    rm.set_materialized(mu_weights(info), rows=x.shape[0])
    assert not torch.allclose(routed, rm.model(x).logits, atol=1e-4)
    with arrow_routing(rm, plan):
        rm.set_weights(None)  # what evaluate's set_plan does for adapter=None: the pinned plan still routes
        torch.testing.assert_close(rm.model(x).logits, routed)


@torch.no_grad()
def test_the_models_plan_and_layers_are_restored_after_use_and_after_an_error(inventory, tokenizer):
    rm, info = inventory
    x = ids(tokenizer)
    rm.set_materialized(mu_weights(info), rows=x.shape[0])
    before_plan, before = rm.batch.plan, rm.model(x).logits
    plan = arrow_plan(rm)
    with pytest.raises(RuntimeError, match="boom"), arrow_routing(rm, plan):
        assert all(layer.batch is not rm.batch for layer in rm.layers)
        raise RuntimeError("boom")
    assert all(layer.batch is rm.batch for layer in rm.layers)
    assert rm.batch.plan is before_plan
    torch.testing.assert_close(rm.model(x).logits, before)
    rows = [ex.to_dict() for ex in examples(parse_task("upper.inc"), 3, seed=0, split="test")]
    arrow_score_rows(rm, tokenizer, rows, top_k=2, batch_size=2)
    assert all(layer.batch is rm.batch for layer in rm.layers)
    assert rm.batch.plan is before_plan


def test_scoring_with_arrow_on_identical_skills_matches_mu(inventory, tokenizer):
    """Generation (with its KV cache: one token per forward) and loss run under the pinned plan."""
    rm, info = inventory
    make_skills_identical(rm)
    rows = [ex.to_dict() for ex in examples(parse_task("upper.inc"), 4, seed=0, split="test")]
    got = arrow_score_rows(rm, tokenizer, rows, top_k=2, batch_size=2)
    want = score_rows(rm, mu_weights(info), tokenizer, rows, batch_size=2)
    assert got["exact_match"] == want["exact_match"]
    assert math.isfinite(got["loss"]) and got["loss"] == pytest.approx(want["loss"], rel=1e-4)
    bare = score_rows(rm, None, tokenizer, rows, batch_size=2)
    assert bare["loss"] != pytest.approx(want["loss"], rel=1e-4)


def test_bad_settings_are_refused_naming_the_field(inventory):
    rm, _ = inventory
    with pytest.raises(ValueError, match="top_k"):
        ArrowConfig(top_k=0)
    with pytest.raises(ValueError, match="temperature"):
        ArrowConfig(temperature=0.0)
    with pytest.raises(ValueError, match="top_k=5 exceeds"):
        arrow_plan(rm, top_k=N_SKILLS + 1)
