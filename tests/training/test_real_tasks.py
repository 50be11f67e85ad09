"""The real held-out tasks (training/real_tasks.py): well-formed, a fixed test split, and outside every
inventory's training (the procedural suite's tasks and examples, the BIG-bench training tasks)."""

from __future__ import annotations

import json
import string

import pytest

from training import bigbench
from training.real_tasks import N_PAIRS, N_TEST, PAIRS, REAL_TASKS, real_task_examples
from training.shipped_inventory import PACKAGE_DIR
from training.suite import build_suite, candidate_pool, examples, parse_task

TASKS = (
    "capital", "city-country", "antonym", "past-tense", "number-word", "sentiment", "name-in-sentence",
    "last-word-first",
)
UNITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
         "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
TENS = {2: "twenty", 3: "thirty", 4: "forty", 5: "fifty", 6: "sixty", 7: "seventy", 8: "eighty", 9: "ninety"}


def spell(n: int) -> str:
    """1-99 in lowercase English words, hyphenated compounds."""
    if n < 20:
        return UNITS[n]
    tens, units = divmod(n, 10)
    return TENS[tens] + (f"-{UNITS[units]}" if units else "")


def shipped_training_tasks() -> set[str]:
    """The tasks the shipped inventory was trained on (the wide suite's) and whose routing rows it ships."""
    inventory = json.loads((PACKAGE_DIR / "inventory" / "inventory.json").read_text())
    return set(inventory["made_by"]["tasks"]) | {p.name for p in (PACKAGE_DIR / "tasks").iterdir()}


def real_ids() -> set[str]:
    return set(TASKS) | {f"real-{t}" for t in TASKS}


def all_pairs() -> set[tuple[str, str]]:
    return {pair for pairs in PAIRS.values() for pair in pairs}


# --- the data -----------------------------------------------------------------------------------

def test_the_eight_tasks_have_32_distinct_inputs_and_answers():
    assert tuple(REAL_TASKS) == tuple(PAIRS) == TASKS
    assert all(REAL_TASKS[t].strip() for t in TASKS)
    for task, pairs in PAIRS.items():
        assert len(pairs) == N_PAIRS == 2 * N_TEST, task
        inputs = [x for x, _ in pairs]
        assert len(set(inputs)) == N_PAIRS, task
        for x, y in pairs:
            assert x.strip() == x and y.strip() == y and x and y, (task, x, y)


def test_sentiment_is_balanced_and_interleaved():
    labels = [y for _, y in PAIRS["sentiment"]]
    assert labels == ["positive", "negative"] * 16
    assert labels[-N_TEST:].count("positive") == labels[:N_TEST].count("positive") == 8
    for x, _ in PAIRS["sentiment"]:
        assert 6 <= len(x.split()) <= 14, x


def test_last_word_first_outputs_are_the_rotation_of_their_inputs():
    for x, y in PAIRS["last-word-first"]:
        words = x.split()
        assert 4 <= len(words) <= 7 and not set(x) & set(string.punctuation), x
        assert y.split() == [words[-1], *words[:-1]] and y == " ".join(y.split()), (x, y)
        assert y != x


def test_number_words_match_an_independent_spelling():
    assert spell(42) == "forty-two" and spell(13) == "thirteen" and spell(80) == "eighty"
    for x, y in PAIRS["number-word"]:
        assert x.isdigit() and 1 <= int(x) <= 99 and str(int(x)) == x
        assert y == spell(int(x)), x


def test_each_sentence_names_exactly_one_person():
    positions = set()
    for x, name in PAIRS["name-in-sentence"]:
        words = [w.strip(string.punctuation) for w in x.split()]
        capitalised = [w for i, w in enumerate(words) if w[:1].isupper() and (i > 0 or w == name)]
        assert capitalised == [name], x
        i = words.index(name)
        positions.add("first" if i == 0 else "last" if i == len(words) - 1 else "middle")
    assert positions == {"first", "middle", "last"}


def test_every_answer_is_a_single_one_per_input():
    for task, pairs in PAIRS.items():
        answers: dict[str, set[str]] = {}
        for x, y in pairs:
            answers.setdefault(x.lower(), set()).add(y)
        assert all(len(a) == 1 for a in answers.values()), task


# --- the split ----------------------------------------------------------------------------------

@pytest.mark.parametrize("task", TASKS)
def test_the_test_examples_are_fixed_and_never_drawn_for_training(task):
    _, reference = real_task_examples(task, 4, seed=0)
    assert [(e.input, e.output) for e in reference] == list(PAIRS[task][-N_TEST:])
    assert all(e.task == f"real-{task}" for e in reference)
    for seed in range(5):
        for k in (4, 16):
            train, test = real_task_examples(task, k, seed)
            assert test == reference
            assert len(train) == k == len(set(train))
            assert not set(train) & set(test)
            assert {(e.input, e.output) for e in train} <= set(PAIRS[task][:N_TEST])
            assert all(e.task == f"real-{task}" for e in train)
            assert real_task_examples(task, k, seed) == (train, test)
    draws = {tuple(e.input for e in real_task_examples(task, 4, seed)[0]) for seed in range(5)}
    assert len(draws) > 1


def test_unknown_task_or_too_many_examples_is_refused():
    with pytest.raises(ValueError):
        real_task_examples("real-capital", 4, seed=0)
    with pytest.raises(ValueError):
        real_task_examples("capital", 17, seed=0)
    with pytest.raises(ValueError):
        real_task_examples("capital", -1, seed=0)


# --- held out of every inventory's training --------------------------------------------------

def test_no_real_task_is_a_procedural_suite_task():
    procedural = {t.name for t in candidate_pool()}  # every composition any suite draws from
    procedural |= {t.name for t in build_suite(0).all_tasks}
    assert not real_ids() & (procedural | shipped_training_tasks())
    for task in real_ids():
        with pytest.raises(ValueError):
            parse_task(task)


def test_no_real_pair_is_among_the_procedural_training_examples():
    sample = [t.name for t in build_suite(0).train_tasks] + sorted(shipped_training_tasks())[::10]
    real = all_pairs()
    for spec in map(parse_task, dict.fromkeys(sample)):
        generated = {(e.input, e.output) for e in examples(spec, 300, seed=0, split="train")}
        assert not generated & real, spec.name


def test_no_real_task_id_is_a_bigbench_task_id():
    """BIG-bench ids are "bb-<source>[.<subtask>]", so a real task's id is never one."""
    for source in [*REAL_TASKS, *bigbench.BBH_SOURCES]:
        for subtask in (None, "capital"):
            tid = bigbench.task_id(source, subtask)
            assert tid.startswith("bb-") and tid not in real_ids()


def test_no_real_task_or_pair_is_in_the_bigbench_training_suite():
    """With the suite built on this machine: none of its training tasks or examples is a real one."""
    try:
        suite = bigbench.training_suite(bigbench.MAX_EXAMPLES_PER_TASK)
    except FileNotFoundError:
        pytest.skip("no BIG-bench suite built on this machine")
    assert not real_ids() & set(suite)
    real = all_pairs()
    assert not any((e.input, e.output) in real for exs in suite.values() for e in exs)
