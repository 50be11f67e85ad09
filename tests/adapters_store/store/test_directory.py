"""The directory store's own behaviour: files, atomic writes, crashes, temp sweeps (the semantics
every backend shares are in test_store_contract.py)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch.testing import assert_close

from adapters_store.store import atomic
from adapters_store.store.directory import DirectoryStore
from adapters_store.store.errors import StoreError
from tests.adapters_store.store.test_contract import DIMS, NAMES, SPEC, skills


@pytest.fixture
def store(tmp_path) -> DirectoryStore:
    s = DirectoryStore(tmp_path / "store")
    s.save_inventory(SPEC, NAMES, DIMS, skills(), backbone_fingerprint="llama-abc", backbone_name="tiny")
    return s


def test_a_rewritten_task_keeps_one_weights_file(store):
    logits = torch.randn(2, 2, 3)
    store.put_routing("t1", logits)
    store.put_routing("t1", logits + 1)
    assert_close(store.load_routing("t1"), logits + 1)
    assert len(list((store.root / "tasks" / "t1").glob("routing-*.safetensors"))) == 1


def test_adding_a_task_keeps_other_tasks_bit_identical(store):
    store.put_routing("a", torch.randn(2, 2, 3))
    before = {p.name: p.read_bytes() for p in (store.root / "tasks" / "a").iterdir()}
    store.put_routing("b", torch.randn(2, 2, 3))
    store.put_lora("c", {"x.A": torch.randn(8, 2), "x.B": torch.randn(2, 8)}, method="full")
    after = {p.name: p.read_bytes() for p in (store.root / "tasks" / "a").iterdir()}
    assert before == after
    assert [r.id for r in store.list_tasks()] == ["a", "b", "c"]


@pytest.mark.parametrize("bad", ["../x", "", "a" * 65, "Upper", "a/b", "..", "x\n"])
def test_bad_task_ids_are_refused_everywhere(store, bad):
    with pytest.raises(ValueError, match="task id"):
        store.put_routing(bad, torch.randn(2, 2, 3))
    with pytest.raises(ValueError, match="task id"):
        store.get_task(bad)
    with pytest.raises(ValueError, match="task id"):
        store.delete_task(bad)
    assert not any(p.name.startswith("..") for p in store.root.rglob("*"))


def test_crash_during_write_keeps_the_old_state(store, monkeypatch):
    logits = torch.randn(2, 2, 3)
    store.put_routing("t1", logits)

    def crash(src, dst):
        raise OSError("simulated crash during rename")

    monkeypatch.setattr(atomic.os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        store.put_routing("t1", logits * 5)
    with pytest.raises(OSError, match="simulated crash"):
        store.save_inventory(SPEC, NAMES, DIMS, skills(1), backbone_fingerprint="llama-abc")
    monkeypatch.undo()
    assert_close(store.load_routing("t1"), logits)
    assert store.get_task("t1").version == 1
    _info, tensors = store.load_inventory("llama-abc")
    assert torch.equal(tensors[f"{NAMES[0]}.A"], skills()[f"{NAMES[0]}.A"])
    assert not [p for p in store.root.rglob("*") if p.name.startswith(atomic.TMP_PREFIX)]


def test_process_killed_mid_write_leaves_old_state_and_temp_is_swept(store, tmp_path):
    """A writer killed between write and rename (os._exit, no cleanup) leaves a temp file only."""
    logits = torch.randn(2, 2, 3)
    store.put_routing("t1", logits)
    pid = os.fork()
    if pid == 0:  # child: write the temp file, then die before the rename
        try:
            atomic.os.replace = lambda *a: os._exit(17)  # type: ignore[assignment]
            store.put_routing("t1", logits * 3)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 17
    leftovers = [p for p in store.root.rglob("*") if p.name.startswith(atomic.TMP_PREFIX)]
    assert leftovers, "the killed writer should have left its temp file behind"
    reopened = DirectoryStore(store.root)  # opening a store never touches a temp file that may be a live write
    assert_close(reopened.load_routing("t1"), logits)
    assert sorted(p for p in store.root.rglob("*") if p.name.startswith(atomic.TMP_PREFIX)) == sorted(leftovers)
    old = time.time() - atomic.SWEEP_GRACE_SECONDS - 60
    for p in leftovers:
        os.utime(p, (old, old))
    DirectoryStore(store.root)  # past the grace period: abandoned, swept
    assert not [p for p in store.root.rglob("*") if p.name.startswith(atomic.TMP_PREFIX)]


def test_opening_a_store_leaves_another_process_write_in_progress_alone(store):
    """A CLI command opening the store while a server writes must not delete the server's temp file."""
    live = store.root / "tasks" / f"{atomic.TMP_PREFIX}task.json.{os.getpid()}.abcd1234"
    live.parent.mkdir(parents=True, exist_ok=True)
    live.write_bytes(b"half")
    DirectoryStore(store.root)
    assert live.exists()
    assert atomic.sweep_temp_files(store.root, now=time.time() + atomic.SWEEP_GRACE_SECONDS + 1) == 1


def test_tampered_skills_detected(store):
    path = store.root / "inventory" / "skills.safetensors"
    from safetensors.torch import save

    path.write_bytes(save(skills(9)))
    with pytest.raises(StoreError, match="does not match"):
        store.load_inventory()


def test_no_pickle_anywhere(store):
    store.put_routing("t1", torch.randn(2, 2, 3))
    suffixes = {p.suffix for p in store.root.rglob("*") if p.is_file()}
    assert suffixes <= {".json", ".safetensors", ""}


