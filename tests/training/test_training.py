"""Multi-task pre-training on the tiny model: batching, methods, routing table, checkpoints, store,
Z statistics, routing plot, default-inventory install, CLI."""

from __future__ import annotations

import copy
import itertools
import json
import math
import random

import pytest
import torch
from click.testing import CliRunner

from adapters_store.backbone.load import Backbone, fingerprint
from adapters_store.lora.spec import InventorySpec
from adapters_store.store.directory import DirectoryStore
from training.batch_sampling import draw_candidates, draw_rows, most_uncertain, task_probabilities
from training.batching import IGNORE, collate, collate_prompts, encode_example, position_ids
from training.data import Example
from training.evaluate import heldout_loss
from training.routing_table import FIXED, RoutingTable, method_shape
from training.suite import examples, parse_task
from training.trainer import TrainConfig, Trainer, build_optimizer, lr_multiplier
from training.zstats import discreteness, sparsity, usage, z_stats

TASKS = ("upper", "rev-words", "inc")


pytestmark = pytest.mark.usefixtures("one_thread")


def toy_tasks(n: int = 16) -> dict[str, list[Example]]:
    return {t: examples(parse_task(t), n, seed=0, split="train") for t in TASKS}


def backbone(model, tokenizer) -> Backbone:
    return Backbone(model, tokenizer, "tiny", fingerprint(model), 0.0)


def config(method: str, **kw) -> TrainConfig:
    base = {"method": method, "n_skills": 4, "n_heads": 2, "rank": 4, "steps": 30, "batch_size": 8, "lr_skills": 1e-2,
                "autocast": "none", "seed": 0, "warmup": 0.1}
    base.update(kw)
    return TrainConfig(**base)


def mean_task_loss(trainer: Trainer, tasks: dict[str, list[Example]]) -> float:
    total = 0.0
    for i, name in enumerate(trainer.task_names):
        w = trainer.table.weights(torch.tensor([i]), train=False)[:, 0]  # (L, h, S)
        total += heldout_loss(trainer.rm, w.detach(), trainer.backbone.tokenizer, tasks[name])
    return total / len(tasks)


# -- batching -------------------------------------------------------------------------------------

def test_encode_masks_the_prompt_and_ends_with_eos(tokenizer):
    enc = encode_example(tokenizer, Example("upper", "cat 3", "CAT 3"))
    target = tokenizer(" CAT 3", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    n_prompt = len(tokenizer("Input: cat 3\nOutput:").input_ids)
    assert list(enc.labels) == [IGNORE] * n_prompt + target
    assert list(enc.input_ids[n_prompt:]) == target
    assert enc.n_target == len(target)


def test_max_length_cuts_the_prompt_from_the_left(tokenizer):
    enc = encode_example(tokenizer, Example("upper", "cat " * 40 + "3", "X"), max_length=20)
    assert len(enc.input_ids) == 20
    assert enc.labels[-1] == tokenizer.eos_token_id and enc.n_target == 3  # " X" + eos


@pytest.mark.parametrize("side", ["left", "right"])
def test_collate_pads_with_mask_and_ignored_labels(tokenizer, side):
    encs = [encode_example(tokenizer, Example("t", x, y)) for x, y in [("a 1", "b"), ("cat dog 12", "x y z")]]
    b = collate(encs, pad_id=256, side=side)
    lengths = [len(e.input_ids) for e in encs]
    assert b.input_ids.shape == (2, max(lengths))
    assert b.attention_mask.sum(1).tolist() == lengths
    assert ((b.labels != IGNORE) <= (b.attention_mask == 1)).all()
    short = 0 if lengths[0] < lengths[1] else 1
    pad_at = 0 if side == "left" else -1
    assert b.attention_mask[short, pad_at] == 0 and b.input_ids[short, pad_at] == 256


def test_prompts_are_left_padded_and_positions_skip_padding(tokenizer):
    b = collate_prompts(tokenizer, ["a 1", "cat dog 12"])
    assert (b.attention_mask[:, -1] == 1).all() and b.attention_mask[0, 0] == 0
    pos = position_ids(b.attention_mask)
    assert pos[0, -1] == b.attention_mask[0].sum() - 1


# -- pure helpers -----------------------------------------------------------------------------------

def test_lr_schedule_warms_up_then_decays():
    lrs = [lr_multiplier(s, 100, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:])) and lrs[-1] >= 0.1


def test_sampling_modes():
    assert task_probabilities([1, 3], "uniform") == [0.5, 0.5]
    assert task_probabilities([1, 3], "proportional") == [0.25, 0.75]
    rows = draw_rows([2, 5], 50, "proportional", random.Random(0))
    assert all(0 <= i < [2, 5][t] for t, i in rows)
    cands = draw_candidates([2, 5, 3], pool=2, rng=random.Random(0))
    assert [t for t, _ in cands] == [0, 0, 1, 1, 2, 2]
    assert most_uncertain(torch.tensor([0.1, 0.9, 0.5, 0.95]), 2) == [1, 3]


def test_method_shapes():
    assert method_shape("poly", 5, 8, 4).n_heads == 1
    assert (method_shape("shared", 5, 8, 4).n_skills, method_shape("shared", 5, 8, 4).trainable) == (1, False)
    assert method_shape("private", 5, 8, 4).n_skills == 5
    assert method_shape("hyper", 5, 8, 4).routing == "hyper"
    with pytest.raises(ValueError, match="method must be one of"):
        method_shape("moe", 5, 8, 4)


# -- the routing table --------------------------------------------------------------------------

def test_routing_table_init_and_weights():
    spec = InventorySpec(4, 2, 4)
    table = RoutingTable("mhr", ["a", "b", "c"], L=3, spec=spec)
    assert table.logits.shape == (3, 3, 2, 4) and table.logits.abs().max() <= 1e-3
    w = table.weights(torch.tensor([0, 2, 2]), train=False)
    assert w.shape == (3, 3, 2, 4)
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 3, 2))
    g = torch.Generator().manual_seed(0)
    noisy = table.weights(torch.tensor([0]), train=True, generator=g)
    assert not torch.allclose(noisy, w[:, :1]) and torch.allclose(noisy.sum(-1), torch.ones(3, 1, 2))
    assert torch.equal(table.weights(torch.tensor([0]), train=True, gumbel=False), w[:, :1])


def test_private_and_random_mu_rows_are_fixed_routings():
    private = RoutingTable("private", ["a", "b", "c"], L=2, spec=InventorySpec(3, 1, 4))
    w = private.weights(torch.tensor([0, 1, 2]), train=True)  # (L, 3, 1, 3)
    torch.testing.assert_close(w[:, :, 0], torch.eye(3).expand(2, 3, 3), atol=1e-6, rtol=0)
    rmu = RoutingTable("random-mu", ["a", "b"], L=2, spec=InventorySpec(4, 2, 4))
    w = rmu.weights(torch.tensor([0, 1]), train=True)
    assert set(torch.round(w * 4).unique().tolist()) == {0.0, 2.0}  # 1/2 on half the skills
    assert ((rmu.logits.abs() == FIXED).all()) and not rmu.logits.requires_grad


def test_add_task_keeps_existing_rows_bit_identical():
    table = RoutingTable("mhr", ["a", "b"], L=3, spec=InventorySpec(4, 2, 4))
    with torch.no_grad():
        table.logits.normal_()
    before = table.logits.detach().clone()
    assert table.add_task("c") == 2
    assert torch.equal(table.logits[:2], before) and table.logits.shape[0] == 3
    assert table.logits.requires_grad and table.logits[2].abs().max() <= 1e-3
    private = RoutingTable("private", ["a"], L=1, spec=InventorySpec(2, 1, 4))
    private.add_task("b")
    assert private.logits[1, 0, 0].argmax() == 1
    with pytest.raises(ValueError, match="already"):
        table.add_task("a")


# -- training ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["poly", "mhr", "shared", "private", "random-mu", "hyper"])
def test_loss_falls_for_every_method(tiny_model, tokenizer, method):
    tasks = toy_tasks()
    trainer = Trainer(config(method), backbone(tiny_model, tokenizer), tasks)
    fixed_before = trainer.table.logits.detach().clone()
    before = mean_task_loss(trainer, tasks)
    trainer.run(progress=False)
    after = mean_task_loss(trainer, tasks)
    assert math.isfinite(after) and after < before - 0.05, (before, after)
    if method in ("shared", "private", "random-mu"):
        assert torch.equal(trainer.table.logits, fixed_before)  # never trained
    else:
        assert not torch.equal(trainer.table.logits, fixed_before)


def test_bf16_training_runs_on_bf16_copies_of_the_frozen_weights_with_bit_equal_losses(tiny_base, tokenizer):
    """Under bf16 autocast a training step's forwards run on bf16 copies of the frozen linears'
    weights (no cast in every forward): the losses and the trained skills equal autocast's own casts
    bit for bit, between steps the model holds its own float32 weights, and the copies go at the end."""

    def run(copies: bool):
        model = copy.deepcopy(tiny_base)
        trainer = Trainer(config("mhr", steps=4, autocast="bf16"), backbone(model, tokenizer), toy_tasks(4))
        trainer.bf16_weights.enabled = copies
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        own = [m.weight for m in linears]
        seen: list[torch.dtype] = []
        linears[-1].register_forward_pre_hook(lambda m, _: seen.append(m.weight.dtype))
        losses = []
        for _ in range(3):
            losses.append(trainer.train_step())
            assert all(m.weight is w and w.dtype == torch.float32 for m, w in zip(linears, own, strict=True))
        losses += trainer.run(progress=False)
        assert trainer.bf16_weights._copies is None
        return losses, set(seen), {k: v.clone() for k, v in trainer.rm.skill_tensors().items()}

    with_copies, without = run(True), run(False)
    assert with_copies[1] == {torch.bfloat16} and without[1] == {torch.float32}
    assert with_copies[0] == without[0]
    assert all(torch.equal(with_copies[2][k], without[2][k]) for k in without[2])


def test_routing_logits_have_no_weight_decay(tiny_model, tokenizer):
    trainer = Trainer(config("mhr", weight_decay=0.1), backbone(tiny_model, tokenizer), toy_tasks(4))
    groups = {g["name"]: g for g in trainer.opt.param_groups}
    assert groups["routing"]["weight_decay"] == 0.0 and groups["routing"]["lr"] == 0.1
    assert groups["skills"]["weight_decay"] == 0.1
    assert len(build_optimizer(trainer.table, trainer.rm, trainer.cfg).param_groups) == 2


def test_uncertainty_sampling_trains(tiny_model, tokenizer):
    trainer = Trainer(config("mhr", sampling="uncertainty", uncertainty_pool=3, steps=3),
                      backbone(tiny_model, tokenizer), toy_tasks(8))
    losses = trainer.run(progress=False)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


def test_store_round_trip(tiny_model, tokenizer, tmp_path):
    trainer = Trainer(config("mhr", steps=5), backbone(tiny_model, tokenizer), toy_tasks(8), DirectoryStore(tmp_path))
    trainer.run(progress=False)
    info, skills = DirectoryStore(tmp_path).load_inventory(trainer.backbone.fingerprint)
    assert info.spec == trainer.spec and list(info.layer_names) == trainer.rm.names
    for key, value in trainer.rm.skill_tensors().items():
        assert torch.equal(skills[key], value)
    for i, task in enumerate(trainer.task_names):
        assert torch.equal(DirectoryStore(tmp_path).load_routing(task), trainer.table.logits[i].detach())
        assert DirectoryStore(tmp_path).get_task(task).method == "mhr"


def test_resume_continues_like_an_uninterrupted_run(tiny_base, tokenizer, tmp_path):
    import copy

    tasks = toy_tasks(8)
    straight = Trainer(config("mhr", steps=6), backbone(copy.deepcopy(tiny_base), tokenizer), tasks)
    expected = straight.run(progress=False)

    first = Trainer(config("mhr", steps=6, checkpoint_every=3), backbone(copy.deepcopy(tiny_base), tokenizer),
                    tasks, DirectoryStore(tmp_path))
    head = [first.train_step() for _ in range(3)]
    first.checkpoint()
    second = Trainer(config("mhr", steps=6), backbone(copy.deepcopy(tiny_base), tokenizer), tasks,
                     DirectoryStore(tmp_path))
    second.load_state(tmp_path)
    assert second.step == 3
    tail = second.run(progress=False)
    assert second.step == 6 and all(math.isfinite(x) for x in tail)
    torch.testing.assert_close(torch.tensor(head + tail), torch.tensor(expected), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(second.table.logits, straight.table.logits, rtol=1e-4, atol=1e-6)


def test_resume_refuses_another_configuration(tiny_base, tokenizer, tmp_path):
    import copy

    tasks = toy_tasks(4)
    t = Trainer(config("mhr", steps=1), backbone(copy.deepcopy(tiny_base), tokenizer), tasks, DirectoryStore(tmp_path))
    t.run(progress=False)
    other = Trainer(config("mhr", steps=1, rank=2), backbone(copy.deepcopy(tiny_base), tokenizer), tasks)
    with pytest.raises(ValueError, match="cannot resume"):
        other.load_state(tmp_path)


def test_warm_start_carries_skills_and_shared_rows_and_leaves_new_tasks_fresh(tiny_base, tokenizer, tmp_path):
    import copy

    source = Trainer(config("mhr", steps=4), backbone(copy.deepcopy(tiny_base), tokenizer), toy_tasks(8),
                     DirectoryStore(tmp_path / "src"))
    source.run(progress=False)
    wider = {**toy_tasks(8), "inc.upper": examples(parse_task("inc.upper"), 8, seed=0, split="train")}
    grown = Trainer(config("mhr", steps=4, seed=5), backbone(copy.deepcopy(tiny_base), tokenizer), wider)
    fresh_new_row = grown.table.logits[grown.task_names.index("inc.upper")].detach().clone()
    assert sorted(grown.warm_start(DirectoryStore(tmp_path / "src"))) == sorted(TASKS)
    for name, tensor in source.rm.skill_tensors().items():
        assert torch.equal(grown.rm.skill_tensors()[name], tensor), name  # the source saved float32 here
    for task in TASKS:
        assert torch.equal(grown.table.logits[grown.task_names.index(task)].detach(),
                           source.table.logits[source.task_names.index(task)].detach()), task
    assert torch.equal(grown.table.logits[grown.task_names.index("inc.upper")].detach(), fresh_new_row)
    lineage = grown.cfg.to_json()["extra"]["init_from"]
    assert lineage["inventory_version"] == DirectoryStore(tmp_path / "src").inventory_info().version
    assert lineage["steps"] == 4 and lineage["tasks_carried"] == len(TASKS)
    # a warm start is a better start: the shared tasks' loss is the trained one, not a fresh model's
    cold = Trainer(config("mhr", steps=4, seed=5), backbone(copy.deepcopy(tiny_base), tokenizer), wider)
    assert mean_task_loss(grown, wider) < mean_task_loss(cold, wider)


def test_warm_start_refuses_another_inventory_shape(tiny_base, tokenizer, tmp_path):
    import copy

    Trainer(config("mhr", steps=1), backbone(copy.deepcopy(tiny_base), tokenizer), toy_tasks(4),
            DirectoryStore(tmp_path)).run(progress=False)
    other = Trainer(config("mhr", steps=1, rank=2), backbone(copy.deepcopy(tiny_base), tokenizer), toy_tasks(4))
    with pytest.raises(ValueError, match="--init-from"):
        other.warm_start(DirectoryStore(tmp_path))


def test_warm_start_grows_skills_and_linears_and_starts_near_the_source(tiny_base, tokenizer, tmp_path):
    import copy

    from training.grow import NEW_SKILL_LOGIT

    tasks = toy_tasks(8)
    source = Trainer(config("mhr", steps=20), backbone(copy.deepcopy(tiny_base), tokenizer), tasks,
                     DirectoryStore(tmp_path / "src"))
    source.run(progress=False)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    grown = Trainer(config("mhr", steps=4, n_skills=6, targets=targets, seed=5),
                    backbone(copy.deepcopy(tiny_base), tokenizer), tasks)
    fresh_rows = grown.table.logits.detach().clone()
    assert sorted(grown.warm_start(DirectoryStore(tmp_path / "src"))) == sorted(TASKS)
    old, new = source.rm.skill_tensors(), grown.rm.skill_tensors()
    assert len(new) > len(old) and set(old) < set(new)
    for key, tensor in new.items():
        if key in old:
            assert torch.equal(tensor[:, :4], old[key]), key
        if key.endswith(".B"):  # new skills and new linears start as no-ops
            assert not tensor[:, 4:].any() and (key in old or not tensor.any()), key
    shared = [grown.rm.names.index(n) for n in source.rm.names]
    added = [j for j in range(len(grown.rm.names)) if j not in shared]
    for task in TASKS:
        i, k = grown.task_names.index(task), source.task_names.index(task)
        row = grown.table.logits[i].detach()
        assert torch.equal(row[shared, :, :4], source.table.logits[k].detach())
        assert torch.all(row[shared, :, 4:] == NEW_SKILL_LOGIT)
        assert torch.equal(row[added], fresh_rows[i, added])
    assert grown.cfg.to_json()["extra"]["init_from"]["grown_from"] == {"n_skills": 4, "linears": len(old) // 2}
    # the grown model computes nearly what the source learnt, far from where a cold start begins
    cold = Trainer(config("mhr", steps=4, n_skills=6, targets=targets, seed=5),
                   backbone(copy.deepcopy(tiny_base), tokenizer), tasks)
    trained, start, fresh = mean_task_loss(source, tasks), mean_task_loss(grown, tasks), mean_task_loss(cold, tasks)
    assert abs(start - trained) < 0.02 * (fresh - trained), (trained, start, fresh)  # 0.09 with new logits at 0
    grown.run(progress=False)  # and it trains on from there
    assert mean_task_loss(grown, tasks) < fresh


@pytest.mark.parametrize("kw, match", [
    ({"n_skills": 2}, "cannot shrink skills"),
    ({"rank": 2}, "cannot grow rank"),
    ({"n_heads": 1}, "cannot grow n_heads"),
    ({"targets": ("q_proj", "v_proj")}, "does not adapt 4 linear"),
    ({"method": "hyper"}, "sigmoid-routed"),
])
def test_warm_start_refuses_what_cannot_grow(tiny_base, tokenizer, tmp_path, kw, match):
    import copy

    Trainer(config("mhr", steps=1), backbone(copy.deepcopy(tiny_base), tokenizer), toy_tasks(4),
            DirectoryStore(tmp_path)).run(progress=False)
    cfg = config(kw.pop("method", "mhr"), steps=1, **kw)
    other = Trainer(cfg, backbone(copy.deepcopy(tiny_base), tokenizer), toy_tasks(4))
    with pytest.raises(ValueError, match=f"--init-from.*{match}"):
        other.warm_start(DirectoryStore(tmp_path))


# -- Z statistics ---------------------------------------------------------------------------------

def test_z_stats_on_hand_made_matrices():
    binary = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0]])
    assert discreteness(binary) == pytest.approx(1.0)
    assert sparsity(binary) == pytest.approx(0.5)
    assert usage(binary) == pytest.approx(1.0)
    half = torch.full((3, 4), 0.5)
    assert discreteness(half) == pytest.approx(0.0, abs=1e-12)
    one_skill = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert usage(one_skill) == pytest.approx(0.0, abs=1e-9) and sparsity(one_skill) == pytest.approx(1 / 3)
    assert 0 < discreteness(torch.tensor([[0.9, 0.1]])) < 1
    logits = torch.tensor([[[[30.0, -30.0]]], [[[-30.0, 30.0]]]])  # (T=2, L=1, h=1, S=2)
    stats = z_stats(logits)
    assert stats == pytest.approx({"discreteness": 1.0, "sparsity": 0.5, "usage": 1.0}, abs=1e-9)


# -- plot, default inventory, CLI --------------------------------------------------------------

def test_routing_plot_writes_a_png(tmp_path):
    from training.plot import routing_plot

    logits = torch.randn(5, 3, 2, 4, generator=torch.Generator().manual_seed(0))
    out = routing_plot(logits, [f"t{i}" for i in range(5)], tmp_path / "r.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_install_default_inventory_copies_once(tiny_model, tokenizer, tmp_path):
    from training.shipped_inventory import export_store, install_default_inventory

    trainer = Trainer(config("mhr", steps=2), backbone(tiny_model, tokenizer), toy_tasks(4),
                      DirectoryStore(tmp_path / "a"))
    trainer.run(progress=False)
    shipped = tmp_path / "pkg" / "default_inventory"
    summary = export_store(tmp_path / "a", shipped)
    assert summary["tasks"] == len(TASKS) and not (shipped / "training").exists()
    work = DirectoryStore(tmp_path / "work")
    assert install_default_inventory(work, source=shipped) is True
    info, _skills = work.load_inventory(trainer.backbone.fingerprint)
    assert info.version == DirectoryStore(tmp_path / "a").inventory_info().version
    assert sorted(r.id for r in work.list_tasks()) == sorted(TASKS)
    assert torch.equal(work.load_routing("upper"), DirectoryStore(tmp_path / "a").load_routing("upper"))
    assert install_default_inventory(work, source=shipped) is False  # never overwrites
    assert install_default_inventory(DirectoryStore(tmp_path / "w2"), source=tmp_path / "missing") is False



def test_the_shipped_package_data_stays_within_its_budget():
    from training.shipped_inventory import (
        PACKAGE_BUDGET_BYTES,
        PACKAGE_DIR,
        WORDS_DIR,
        default_inventory_available,
        tree_bytes,
    )

    assert default_inventory_available(), "training/default_inventory/ is tracked in git and ships in the wheel"
    assert PACKAGE_BUDGET_BYTES == 40 * 1000 * 1000
    assert 0 < tree_bytes(PACKAGE_DIR, WORDS_DIR) <= PACKAGE_BUDGET_BYTES


def test_an_export_over_the_budget_is_refused_and_leaves_the_package_as_it_was(tiny_model, tokenizer, tmp_path):
    from training.shipped_inventory import WORDS_DIR, export_store, tree_bytes

    trainer = Trainer(config("mhr", steps=1), backbone(tiny_model, tokenizer), toy_tasks(2),
                      DirectoryStore(tmp_path / "a"))
    trainer.run(progress=False)
    shipped = tmp_path / "pkg" / "default_inventory"
    first = export_store(tmp_path / "a", shipped)
    assert first["package_bytes"] == tree_bytes(shipped, WORDS_DIR)
    before = {p.relative_to(shipped): p.read_bytes() for p in shipped.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="over its budget"):
        export_store(tmp_path / "a", shipped, budget=int(first["package_bytes"]) - 1)
    assert {p.relative_to(shipped): p.read_bytes() for p in shipped.rglob("*") if p.is_file()} == before
    assert not (tmp_path / "pkg" / "default_inventory.tmp").exists()
    assert (export_store(tmp_path / "a", shipped, budget=int(first["package_bytes"]))["package_bytes"]
            == first["package_bytes"])

def test_cli_train_eval_adapt_plot(tmp_path):
    from training import cli

    runner = CliRunner()
    store = str(tmp_path / "store")
    res = runner.invoke(cli.train, ["--suite", "procedural", "--method", "mhr", "--backbone", "tiny", "--skills", "2",
                                    "--heads", "2", "--rank", "2", "--steps", "2", "--store", store,
                                    "--examples-per-task", "2", "--no-progress", "--autocast", "none"])
    assert res.exit_code == 0, res.output
    assert len(DirectoryStore(store).list_tasks()) == 48
    ex = tmp_path / "ex.jsonl"
    ex.write_text("".join(json.dumps({"input": e.input, "output": e.output}) + "\n"
                          for e in examples(parse_task("upper.inc"), 8, seed=0)))
    res = runner.invoke(cli.adapt, ["--task", "new-task", "--examples", str(ex), "--store", store,
                                    "--backbone", "tiny", "--steps", "2"])
    assert res.exit_code == 0, res.output
    assert DirectoryStore(store).get_task("new-task").method == "routing"
    res = runner.invoke(cli.eval, ["--store", store, "--backbone", "tiny", "--tasks", "upper,new-task", "--n", "2"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.index("{"):])
    assert set(summary["tasks"]) == {"upper"} and 0 <= summary["z_stats"]["discreteness"] <= 1
    # training words and held-out words side by side; the first vocabulary fills the top-level figures
    assert set(summary["mean_exact_match_by_vocab"]) == {"train", "heldout", "madeup"}
    row = summary["tasks"]["upper"]
    assert set(row["by_vocab"]) == {"train", "heldout", "madeup"} and row["loss"] == row["by_vocab"]["train"]["loss"]
    assert row["by_vocab"]["madeup"]["loss"] != row["by_vocab"]["train"]["loss"]  # other inputs
    res = runner.invoke(cli.eval, ["--store", store, "--backbone", "tiny", "--tasks", "upper", "--n", "2",
                                   "--vocabs", "legacy,klingon"])
    assert res.exit_code == 2 and "--vocabs" in res.output
    res = runner.invoke(cli.routing_plot, ["--store", store, "--out", str(tmp_path / "p.png")])
    assert res.exit_code == 0 and (tmp_path / "p.png").stat().st_size > 1000
