"""The far held-out set (training/far_heldout.py): outside every training suite, and far from it."""

from __future__ import annotations

import json

from training.far_heldout import (
    FAR_BOUND,
    FAR_HELDOUT,
    REFERENCE_PAIRS,
    REFERENCE_TRIPLES,
    agreement_inputs,
    far_tasks,
    near_far,
    near_heldout,
    nearest,
    wide_suite,
)
from training.shipped_inventory import PACKAGE_DIR
from training.suite import build_suite, parse_task, probe_inputs


def test_far_tasks_are_distinct_valid_compositions_apart_from_the_held_out_ones():
    assert len(FAR_HELDOUT) == len(set(FAR_HELDOUT)) == 16
    assert all(parse_task(name).name == name for name in FAR_HELDOUT)
    assert not set(FAR_HELDOUT) & {t.name for t in build_suite(0).heldout_tasks}


def test_no_far_task_is_in_a_training_suite():
    """Neither by name nor as the same function under another name (on the probe inputs): not in the
    shipped suite's 48, nor in the suite the shipped inventory was trained on, nor among the tasks whose
    routing rows it ships."""
    reference = build_suite(0, n_pairs=(REFERENCE_PAIRS, 8), n_triples=(REFERENCE_TRIPLES, 8))  # as drawn: no exclude
    assert reference == wide_suite(REFERENCE_PAIRS, REFERENCE_TRIPLES)
    shipped = wide_suite()
    assert {t.name for t in reference.train_tasks} <= {t.name for t in shipped.train_tasks}
    inventory = json.loads((PACKAGE_DIR / "inventory" / "inventory.json").read_text())
    trained = set(inventory["made_by"]["tasks"]) | {p.name for p in (PACKAGE_DIR / "tasks").iterdir()}
    assert trained == {t.name for t in shipped.train_tasks}
    assert not set(FAR_HELDOUT) & trained
    probes = probe_inputs()
    train_sigs = {tuple(t.apply(x) for x in probes) for t in shipped.train_tasks}
    assert not [t.name for t in far_tasks() if tuple(t.apply(x) for x in probes) in train_sigs]


def test_the_nearest_training_task_agrees_on_at_most_30_percent_of_the_fixed_inputs():
    inputs = agreement_inputs()  # 1,000 inputs from a fixed seed
    assert inputs == agreement_inputs() and len(set(inputs)) > 900
    found = nearest(far_tasks(), wide_suite().train_tasks, inputs)
    assert max(share for share, _ in found) <= FAR_BOUND, found
    # the measure itself: a training task agrees with itself everywhere, and these two never agree
    assert nearest([parse_task("upper")], [parse_task("upper"), parse_task("inc")], inputs) == [(1.0, "upper")]
    assert nearest([parse_task("inc")], [parse_task("double")], inputs)[0][0] < 0.1


def test_a_wider_suite_passes_over_the_far_tasks():
    """The inventory search may widen the suite: build_suite(exclude=...) never draws a far task."""
    wide = {"n_pairs": (100, 8), "n_triples": (300, 8)}
    drawn = {t.name for t in build_suite(0, **wide).train_tasks}
    assert set(FAR_HELDOUT) & drawn  # so wide a draw would take some of them...
    kept_out = build_suite(0, **wide, exclude=frozenset(FAR_HELDOUT))
    assert not set(FAR_HELDOUT) & {t.name for t in kept_out.train_tasks}  # ...and exclude keeps them out
    assert len(kept_out.train_tasks) == len(drawn)
    assert not set(FAR_HELDOUT) & {t.name for t in wide_suite(100, 300).train_tasks}


def test_however_wide_the_suite_every_far_task_stays_far():
    """wide_suite passes over the compositions that come nearer than FAR_BOUND to a far task, so even
    the widest suite (every pair and triple the pool allows) keeps the bound."""
    assert near_far(), "some compositions of the pool do come near a far task"
    widest = wide_suite(10_000, 10_000)
    names = {t.name for t in widest.train_tasks}
    assert not names & (near_far() | set(FAR_HELDOUT))
    assert len(widest.train_tasks) > 700
    found = nearest(far_tasks(), widest.train_tasks, agreement_inputs())
    assert max(share for share, _ in found) <= FAR_BOUND, found
    # without the exclusion the same draw would break the bound
    unfiltered = build_suite(0, n_pairs=(10_000, 8), n_triples=(10_000, 8), exclude=frozenset(FAR_HELDOUT))
    assert max(share for share, _ in nearest(far_tasks(), unfiltered.train_tasks, agreement_inputs())) > FAR_BOUND


def test_however_wide_the_suite_no_held_out_composition_gets_a_nearer_training_task():
    """A wider suite would otherwise draw near-copies of the 16 held-out tasks
    (dedupe.first2.rev-chars agrees with first2.rev-chars on every input without a repeated word):
    the protocol would then reward recall, not composition, and stop comparing inventories fairly."""
    held, inputs = build_suite(0).heldout_tasks, agreement_inputs()
    shipped = nearest(held, wide_suite().train_tasks, inputs)
    widest = nearest(held, wide_suite(10_000, 10_000).train_tasks, inputs)
    assert all(w[0] <= s[0] for s, w in zip(shipped, widest, strict=True)), (shipped, widest)
    assert "dedupe.first2.rev-chars" in near_heldout()
    unfiltered = build_suite(0, n_pairs=(10_000, 8), n_triples=(10_000, 8), exclude=frozenset(FAR_HELDOUT))
    assert max(share for share, _ in nearest(held, unfiltered.train_tasks, inputs)) > 0.9
