"""The routed-LoRA model: mixed-task batches equal solo runs, beams, checkpointing, B = 0."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from adapters_store.lora.inject import RoutedModel, find_target_linears
from adapters_store.lora.routing import eval_weights
from adapters_store.lora.spec import MLP_TARGETS, InventorySpec
from adapters_store.store.materialize import layers_from_weights
from adapters_store.store.records import InventoryInfo

TASKS = 3


def routed(model, h=2, targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=0) -> RoutedModel:
    rm = RoutedModel(model, InventorySpec(n_skills=4, n_heads=h, rank=4, target_modules=targets))
    rm.reset_skills(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in rm.layers:
            layer.lora_B.normal_(0, 0.5, generator=gen)
    return rm


def task_logits(rm: RoutedModel, seed: int = 3) -> torch.Tensor:
    """(TASKS, L, h, S)"""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(TASKS, len(rm.layers), rm.spec.n_heads, rm.spec.n_skills, generator=gen) * 2


def row_weights(logits: torch.Tensor, rows: list[int | None]) -> torch.Tensor:
    """(L, N, h, S); None = no adapter (zero weights)."""
    w = eval_weights(logits)
    per_row = [torch.zeros_like(w[0]) if t is None else w[t] for t in rows]
    return torch.stack(per_row, dim=1)


INPUT = torch.randint(0, 250, (5, 6), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("h", [1, 4])
def test_mixed_batch_equals_each_row_alone(tiny_model, h):
    rm = routed(tiny_model, h)
    logits = task_logits(rm)
    rows = [0, 2, None, 1, 2]
    with torch.no_grad():
        rm.set_weights(row_weights(logits, rows))
        mixed = rm.model(input_ids=INPUT).logits
        for n, t in enumerate(rows):
            rm.set_weights(row_weights(logits, [t]))
            alone = rm.model(input_ids=INPUT[n : n + 1]).logits
            assert_close(mixed[n : n + 1], alone, rtol=1e-5, atol=1e-5)


def test_no_adapter_and_zero_B_give_the_base_model(tiny_base, tiny_model):
    rm = RoutedModel(tiny_model, InventorySpec(n_skills=4, n_heads=2, rank=4))
    rm.reset_skills(0)  # B = 0 after reset
    with torch.no_grad():
        base = tiny_base(input_ids=INPUT).logits
        rm.set_weights(None)
        assert_close(rm.model(input_ids=INPUT).logits, base)
        rm.set_weights(row_weights(task_logits(rm), [0, 1, 2, 0, 1]))
        assert_close(rm.model(input_ids=INPUT).logits, base)


def test_gathered_path_equals_skill_space_in_the_model(tiny_model):
    rm = routed(tiny_model, h=4, targets=("q_proj", "v_proj") + MLP_TARGETS)
    logits = task_logits(rm)
    rows = [1, 1, 0, None, 2]
    info = InventoryInfo(rm.spec, tuple(rm.names), tuple(rm.layer_dims()), "fp", "tiny", "v", 0.0)
    skills = rm.skill_tensors()
    tables = [layers_from_weights(info, skills, eval_weights(logits[t])) for t in range(TASKS)]
    zero = [(torch.zeros_like(a), torch.zeros_like(b)) for a, b in tables[0]]
    tables.append(zero)  # table row 3 = no adapter
    A_tables = [torch.stack([tables[g][l][0] for g in range(TASKS + 1)]) for l in range(len(rm.layers))]
    B_tables = [torch.stack([tables[g][l][1] for g in range(TASKS + 1)]) for l in range(len(rm.layers))]
    index = torch.tensor([3 if t is None else t for t in rows])
    with torch.no_grad():
        rm.set_weights(row_weights(logits, rows))
        skill = rm.model(input_ids=INPUT).logits
        rm.set_gathered(A_tables, B_tables, index)
        gathered = rm.model(input_ids=INPUT).logits
    assert_close(gathered, skill, rtol=1e-5, atol=1e-5)


def test_beam_search_and_return_sequences_with_mixed_tasks(tiny_model):
    rm = routed(tiny_model, h=2)
    logits = task_logits(rm)
    prompt = INPUT[:2, :4]
    kwargs = {"max_new_tokens": 5, "num_beams": 3, "num_return_sequences": 2, "do_sample": False, "pad_token_id": 256}
    with torch.no_grad():
        rm.set_weights(row_weights(logits, [0, 2]))
        mixed = rm.model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
        assert mixed.shape[0] == 4
        for n, t in enumerate([0, 2]):
            rm.set_weights(row_weights(logits, [t]))
            alone = rm.model.generate(prompt[n : n + 1], attention_mask=torch.ones_like(prompt[:1]), **kwargs)
            assert torch.equal(mixed[2 * n : 2 * n + 2], alone)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model):
    rm = routed(tiny_model, h=2)
    rm.set_skills_trainable(True)
    logits = task_logits(rm).requires_grad_(True)
    rows = torch.tensor([0, 1, 2, 1])

    def grads(checkpointing: bool) -> list[torch.Tensor]:
        rm.model.train()
        if checkpointing:
            rm.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            rm.model.gradient_checkpointing_disable()
        for p in [*rm.skill_parameters(), logits]:
            p.grad = None
        rm.set_weights(eval_weights(logits[rows]).transpose(0, 1))
        out = rm.model(input_ids=INPUT[:4], labels=INPUT[:4], use_cache=False)
        out.loss.backward()
        return [p.grad.clone() for p in [*rm.skill_parameters(), logits]]

    plain, ckpt = grads(False), grads(True)
    assert any(g.abs().sum() > 0 for g in plain)
    for a, b in zip(plain, ckpt, strict=True):
        assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_unknown_target_module_is_refused(tiny_model):
    with pytest.raises(ValueError, match="match no nn.Linear"):
        find_target_linears(tiny_model, ("q_proj", "qkv"))


def test_heads_that_do_not_divide_are_refused(tiny_model):
    with pytest.raises(ValueError, match="routing heads"):
        RoutedModel(tiny_model, InventorySpec(n_skills=2, n_heads=3, rank=2))


def test_row_count_mismatch_is_an_error(tiny_model):
    rm = routed(tiny_model)
    rm.set_weights(row_weights(task_logits(rm), [0, 1, 2]))
    with pytest.raises(ValueError, match="3 rows but the forward got 4"):
        rm.model(input_ids=INPUT[:4])


@pytest.mark.parametrize("h", [1, 2])
def test_materialized_plan_equals_skill_space_in_values_and_gradients(tiny_model, h):
    """set_materialized (one LoRA per task, gathered per row; one task = two plain GEMMs) gives the
    skill-space forward and the same gradient for the routing logits, for one task and a mix."""
    rm = routed(tiny_model, h)
    logits = task_logits(rm)
    for rows in ([1, 1, 1, 1, 1], [0, 2, 1, 2, 0]):
        grads = []
        outs = []
        for path in ("skill", "materialized"):
            lg = logits.clone().requires_grad_(True)
            w = eval_weights(lg)  # (TASKS, L, h, S)
            if path == "skill":
                rm.set_weights(w[rows].transpose(0, 1))
            elif len(set(rows)) == 1:
                rm.set_materialized(w[rows[0]], rows=len(rows))
            else:
                rm.set_materialized(w, torch.tensor(rows))
            out = rm.model(input_ids=INPUT).logits
            (out.square().mean()).backward()
            outs.append(out.detach())
            grads.append(lg.grad)
        assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
        assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)
        assert grads[0][rows[0]].abs().sum() > 0  # the task's logits do receive a gradient
    rm.set_weights(None)


def test_one_task_tables_are_bit_equal_to_a_combine_per_layer_and_follow_skill_changes(tiny_model):
    """set_materialized for one task combines each group of same-shape layers at once, from skills
    stacked once while frozen: the tables must equal materialize_many layer by layer, bit for bit,
    and must follow every change of the skills (load_skills, in-place writes), never a stale stack."""
    from adapters_store.lora.combine import materialize_many

    rm = routed(tiny_model, 2, targets=("q_proj", "k_proj", "v_proj", "o_proj", *MLP_TARGETS))
    rm.set_skills_trainable(False)  # frozen, as in adaptation and serving: the stacked skills are reused
    assert len(rm._shape_groups) >= 3  # q/o, k/v (GQA), the MLP's shapes
    w = eval_weights(task_logits(rm)[1])  # (L, h, S)

    def check() -> None:
        rm.set_materialized(w, rows=3)
        plan = rm.batch.plan
        for i, layer in enumerate(rm.layers):
            A_t, B_t = materialize_many(layer.lora_A, layer.lora_B, w[i].unsqueeze(0))
            assert torch.equal(plan.A_tables[i], A_t) and torch.equal(plan.B_tables[i], B_t), rm.names[i]

    check()
    rm.load_skills({k: v * 1.5 for k, v in rm.skill_tensors().items()})
    check()
    with torch.no_grad():
        rm.layers[-1].lora_B.add_(1.0)
    check()
    rm.set_weights(None)


def test_one_task_tables_pass_gradients_to_trained_skills(tiny_model):
    rm = routed(tiny_model)
    rm.set_skills_trainable(True)
    try:
        rm.set_materialized(eval_weights(task_logits(rm)[0]), rows=2)
        rm.model(input_ids=INPUT[:2]).logits.square().mean().backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in rm.skill_parameters()[:2])
    finally:
        rm.set_skills_trainable(False)
        rm.set_weights(None)
