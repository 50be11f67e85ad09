"""The procedural compositional task suite (training/suite.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapters_store.store.ids import validate_task_id
from training.suite import (
    PRIMITIVES,
    SPLITS,
    TERMINAL_PRIMITIVES,
    build_suite,
    examples,
    parse_task,
    probe_inputs,
    suite_examples,
)


@pytest.fixture(scope="module")
def suite():
    return build_suite(seed=0)


def test_sizes(suite):
    assert len(suite.train_tasks) >= 48
    assert len(suite.heldout_tasks) >= 12
    assert 12 <= len(PRIMITIVES) <= 16


def test_build_is_deterministic(suite):
    assert build_suite(seed=0) == suite
    assert build_suite(seed=1) != suite


def test_deterministic_across_processes(suite):
    code = (
        "from training.suite import build_suite, examples;"
        "s = build_suite(0);"
        "print([t.name for t in s.heldout_tasks]);"
        "print([(e.input, e.output) for e in examples(s.heldout_tasks[0], 5, seed=3)])"
    )
    env_outs = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       cwd=Path(__file__).resolve().parents[2], env={**os.environ, "PYTHONHASHSEED": h}).stdout
        for h in ("1", "2")
    ]
    assert env_outs[0] == env_outs[1]
    assert env_outs[0].splitlines()[0] == str([t.name for t in suite.heldout_tasks])


def test_names_valid_and_unique(suite):
    names = [t.name for t in suite.all_tasks]
    assert len(set(names)) == len(names)
    for t in suite.all_tasks:
        assert validate_task_id(t.name) == t.name
        assert t.name == ".".join(t.primitives)
        assert 1 <= len(t.primitives) <= 3
        assert all(p in PRIMITIVES for p in t.primitives)
        assert not any(p in TERMINAL_PRIMITIVES for p in t.primitives[:-1])
        assert parse_task(t.name) == t


def test_heldout_compositions_unseen_in_training(suite):
    train = {t.primitives for t in suite.train_tasks}
    assert not any(t.primitives in train for t in suite.heldout_tasks)


def test_heldout_primitives_seen_in_training(suite):
    train_prims = {p for t in suite.train_tasks for p in t.primitives}
    assert {p for t in suite.heldout_tasks for p in t.primitives} <= train_prims
    assert train_prims == set(PRIMITIVES)


def test_tasks_are_distinct_functions_on_probes(suite):
    probes = probe_inputs()
    assert len(probes) == len(set(probes)) == 50
    sigs = {t.name: tuple(t.apply(x) for x in probes) for t in suite.all_tasks}
    train_sigs = {sigs[t.name] for t in suite.train_tasks}
    for t in suite.heldout_tasks:
        assert sigs[t.name] not in train_sigs, t.name
    assert len(set(sigs.values())) == len(sigs)
    assert tuple(probes) not in sigs.values()  # no identity task
    assert all(len(set(s)) > 1 for s in sigs.values())  # no constant task


def test_commuting_pair_not_split_across_train_and_heldout(suite):
    # upper and rev-words commute: at most one ordering may appear in the whole suite.
    names = {t.name for t in suite.all_tasks}
    assert not {"upper.rev-words", "rev-words.upper"} <= names


def test_examples_deterministic_and_seeded(suite):
    task = suite.heldout_tasks[0]
    a = examples(task, 20, seed=7)
    assert a == examples(task, 20, seed=7)
    assert a != examples(task, 20, seed=8)
    assert examples(task, 5, seed=7) == a[:5]
    assert all(e.task == task.name and e.output == task.apply(e.input) for e in a)


def test_splits_differ_and_are_disjoint(suite):
    task = suite.train_tasks[0]
    inputs = {s: {e.input for e in examples(task, 100, seed=0, split=s)} for s in SPLITS}
    assert inputs["train"].isdisjoint(inputs["valid"])
    assert inputs["train"].isdisjoint(inputs["test"])
    assert inputs["valid"].isdisjoint(inputs["test"])
    with pytest.raises(ValueError):
        examples(task, 1, seed=0, split="dev")


def test_examples_non_empty_and_distinct(suite):
    exs = suite_examples(suite.all_tasks, 30, seed=0, split="train")
    assert len(exs) == 30 * len(suite.all_tasks)
    for e in exs:
        assert e.input.strip() and e.output.strip()
        assert e.output == e.output.strip() and "  " not in e.output
        assert 3 <= len(e.input.split()) <= 6
    for t in suite.all_tasks[:5]:
        ins = [e.input for e in examples(t, 50, seed=1)]
        assert len(set(ins)) == len(ins)


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("rev-words", "cat 3 dog", "dog 3 cat"),
        ("upper", "cat 3", "CAT 3"),
        ("title", "cat dog", "Cat Dog"),
        ("sort", "dog 3 cat", "3 cat dog"),
        ("dedupe", "cat dog cat 3 3", "cat dog 3"),
        ("first2", "a b c", "a b"),
        ("last2", "a b c", "b c"),
        ("swap-ends", "a b c", "c b a"),
        ("rotate", "a b c", "b c a"),
        ("rev-chars", "cat 12", "tac 12"),
        ("caesar", "zoo Az 3", "app Ba 3"),
        ("plural", "cat 3", "cats 3"),
        ("inc", "cat 3 20", "cat 4 21"),
        ("double", "cat 3", "cat 6"),
        ("count", "a b 3", "3"),
        ("sum", "a 2 b 5", "7"),
        ("rev-words.upper", "cat 3 dog", "DOG 3 CAT"),
        ("upper.plural", "cat 3", "CATS 3"),
        ("inc.double.sum", "a 1 2", "10"),
    ],
)
def test_primitive_semantics(name, text, expected):
    assert parse_task(name).apply(text) == expected


@pytest.mark.parametrize("bad", ["count.upper", "nope", "upper.upper.upper.upper", ""])
def test_parse_task_rejects(bad):
    with pytest.raises(ValueError):
        parse_task(bad)


def test_a_wider_suite_keeps_the_held_out_tasks_and_the_shipped_training_tasks():
    """scripts/wide_suite.py relies on this: asking for more training compositions only adds
    training tasks; the 16 held-out tasks (what every few-shot figure is measured on) stay."""
    shipped, wide = build_suite(0), build_suite(0, n_pairs=(100, 8), n_triples=(92, 8))
    assert [t.name for t in wide.heldout_tasks] == [t.name for t in shipped.heldout_tasks]
    names = [t.name for t in wide.train_tasks]
    assert len(names) == len(set(names)) == 16 + 100 + 92
    assert {t.name for t in shipped.train_tasks} <= set(names)
    assert not {t.name for t in wide.heldout_tasks} & set(names)
    probes = probe_inputs()  # no training task computes a held-out task's function under another name
    train_sigs = {tuple(t.apply(x) for x in probes) for t in wide.train_tasks}
    assert not [t.name for t in wide.heldout_tasks if tuple(t.apply(x) for x in probes) in train_sigs]
