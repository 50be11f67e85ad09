"""Refining a store's routing heads: every stored task serves the same LoRA, new rows get finer heads."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.testing import assert_close

from adapters_store.lora.spec import InventorySpec
from adapters_store.store.directory import DirectoryStore
from adapters_store.store.errors import StoreError
from adapters_store.store.materialize import task_layers
from adapters_store.store.refine import refine_store

NAMES = ["m.layers.0.q_proj", "m.layers.0.v_proj", "m.layers.1.q_proj"]
DIMS = [(16, 16), (16, 8), (16, 16)]
SPEC = InventorySpec(n_skills=3, n_heads=2, rank=2, target_modules=("q_proj", "v_proj"))


@pytest.fixture
def src(tmp_path) -> DirectoryStore:
    g = torch.Generator().manual_seed(0)
    skills = {}
    for name, (d_in, d_out) in zip(NAMES, DIMS, strict=True):
        skills[f"{name}.A"] = torch.randn(2, 3, d_in // 2, 2, generator=g)
        skills[f"{name}.B"] = torch.randn(2, 3, 2, d_out // 2, generator=g)
    store = DirectoryStore(tmp_path / "src")
    store.save_inventory(SPEC, NAMES, DIMS, skills, backbone_fingerprint="llama-abc", backbone_name="tiny",
                         made_by={"method": "mhr"})
    store.put_routing("alpha", torch.randn(3, 2, 3, generator=g) * 3, method="mhr", source={"kind": "pretraining"})
    store.put_routing("beta", torch.randn(3, 2, 3, generator=g) * 3, method="routing", metrics={"eval_loss": 0.5})
    store.put_record(dataclasses.replace(store.get_task("beta"), prompt_format="chat"))
    lora = {f"{n}.{ab}": torch.randn(*((d_in, 2) if ab == "A" else (2, d_out)), generator=g)
            for n, (d_in, d_out) in zip(NAMES, DIMS, strict=True) for ab in "AB"}
    store.put_lora("gamma", lora, method="mu")
    return store


def served(store: DirectoryStore, task: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    info, skills = store.load_inventory()
    record = store.get_task(task)
    return task_layers(info, skills, record.kind, store.load_weights(record))


def test_every_task_serves_the_same_lora_after_refining(src, tmp_path):
    dst = DirectoryStore(tmp_path / "dst")
    info = refine_store(src, dst, 8)
    assert info.spec.n_heads == 8 and info.made_by == {"method": "mhr", "refined_from_heads": 2}
    assert info.version != src.inventory_info().version
    for task in ("alpha", "beta", "gamma"):
        for (A, B), (A_ref, B_ref) in zip(served(dst, task), served(src, task), strict=True):
            assert_close(A, A_ref, rtol=1e-6, atol=1e-7)  # the same sums, maybe in another order
            assert_close(B, B_ref, rtol=1e-6, atol=1e-7)
    beta = dst.get_task("beta")
    assert dst.load_routing("beta").shape == (3, 8, 3) and beta.params == 3 * 8 * 3
    assert beta.prompt_format == "chat" and beta.metrics == {"eval_loss": 0.5} and beta.method == "routing"
    assert dst.get_task("alpha").source == {"kind": "pretraining"}
    # the refined tasks belong to the new inventory: retrieval's library takes them
    assert {r.inventory_version for r in dst.list_tasks()} == {info.version}
    assert set(dst.routing_rows(limit=10)) == {"alpha", "beta"}


def test_a_finer_row_changes_only_its_own_block(src, tmp_path):
    """What refining buys: two finer heads of one old head can now mix the skills differently."""
    dst = DirectoryStore(tmp_path / "dst")
    refine_store(src, dst, 4)
    row = dst.load_routing("alpha").clone()
    row[0, 1] = torch.tensor([9.0, -9.0, -9.0])  # layer 0, finer head 1 = second half of old head 0
    dst.put_routing("alpha-2", row)
    (A, B), (A_ref, B_ref) = served(dst, "alpha-2")[0], served(dst, "alpha")[0]
    changed = (A - A_ref).abs().sum(1).nonzero().flatten().tolist()
    assert changed == [4, 5, 6, 7]  # d_in 16 / 4 heads: rows 4..7 only
    assert (B - B_ref).abs().sum(0).nonzero().flatten().tolist() == [4, 5, 6, 7]


def test_refining_refuses_a_non_empty_destination_and_bad_head_counts(src, tmp_path):
    with pytest.raises(StoreError, match="not empty"):
        refine_store(src, src, 4)
    with pytest.raises(ValueError, match="routing heads"):
        refine_store(src, DirectoryStore(tmp_path / "a"), 3)  # not a multiple of 2
    with pytest.raises(ValueError, match="routing heads"):
        refine_store(src, DirectoryStore(tmp_path / "b"), 16)  # 16 heads do not divide d_out = 8
    assert not DirectoryStore(tmp_path / "b").has_inventory()


def test_tasks_of_an_older_inventory_or_not_ready_are_left_behind(src, tmp_path):
    src.put_record(dataclasses.replace(src.get_task("alpha"), inventory_version="0ldversion00"))
    src.put_record(dataclasses.replace(src.get_task("gamma"), status="training", file=None))
    dst = DirectoryStore(tmp_path / "dst")
    refine_store(src, dst, 4)
    assert [r.id for r in dst.list_tasks()] == ["beta"]


def test_a_hyper_routed_inventory_refines_to_the_same_adapters(tmp_path):
    """Hyper routing uses the logits as weights: a repeated row is still the same adapter."""
    g = torch.Generator().manual_seed(1)
    spec = dataclasses.replace(SPEC, routing="hyper")
    skills = {}
    for name, (d_in, d_out) in zip(NAMES, DIMS, strict=True):
        skills[f"{name}.A"] = torch.randn(2, 3, d_in // 2, 2, generator=g)
        skills[f"{name}.B"] = torch.randn(2, 3, 2, d_out // 2, generator=g)
    src = DirectoryStore(tmp_path / "src")
    src.save_inventory(spec, NAMES, DIMS, skills, backbone_fingerprint="llama-abc")
    src.put_routing("h", torch.randn(3, 2, 3, generator=g), method="hyper")
    dst = DirectoryStore(tmp_path / "dst")
    assert refine_store(src, dst, 4).spec.routing == "hyper"
    for (A, B), (A_ref, B_ref) in zip(served(dst, "h"), served(src, "h"), strict=True):
        assert_close(A, A_ref, rtol=1e-6, atol=1e-6)
        assert_close(B, B_ref, rtol=1e-6, atol=1e-6)
