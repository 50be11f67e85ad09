"""The BIG-bench suite (training/bigbench.py, scripts/bigbench_suite.py): built offline from an sdist-shaped
archive the test makes itself; BIG-Bench Hard tasks held out whole, never in training."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from training import bigbench
from training.bigbench import BBH_SOURCES, TRAIN_MAX_CHARS

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "bigbench-1.0.0/bigbench/benchmark_tasks"
# The BIG-Bench Hard source tasks, pinned: held out whole with every subtask.
PINNED_BBH = {
    "boolean_expressions", "causal_judgment", "date_understanding", "disambiguation_qa", "dyck_languages",
    "formal_fallacies_syllogisms_negation", "geometric_shapes", "hyperbaton", "logical_deduction",
    "movie_recommendation", "multistep_arithmetic", "navigate", "object_counting", "penguins_in_a_table",
    "reasoning_about_colored_objects", "ruin_names", "salient_translation_error_detection", "snarks",
    "sports_understanding", "temporal_sequences", "tracking_shuffled_objects", "web_of_lies", "word_sorting",
}
# What the real sdist gives (scripts/bigbench_suite.py on bigbench-1.0.0.tar.gz): 24 held-out tasks from
# the 20 BIG-Bench Hard sources that ship JSON (boolean_expressions, multistep_arithmetic and web_of_lies
# are programmatic there).
REAL_HELDOUT_COUNT, REAL_HELDOUT_SOURCES = 24, 20


def gen(i: int, long: bool = False) -> dict:
    word = f"item {i} " + ("x" * TRAIN_MAX_CHARS if long else "")
    return {"input": f"echo {word}", "target": [f"{word}", f"alt {i}"]}


def mc(i: int) -> dict:
    return {"input": f"question {i}?", "target_scores": {f"yes {i}": 1, f"no {i}": 0, "maybe": 0}}


def make_archive(path: Path, extra: dict | None = None) -> Path:
    files = {
        "toy_gen/task.json": {"name": "toy_gen", "examples": [gen(i) for i in range(60)]},
        "toy_mc/task.json": {"name": "toy_mc", "examples": [mc(i) for i in range(50)] + [mc(0)]},  # a duplicate
        "toy_long/task.json": {"name": "toy_long", "examples": [gen(i, long=True) for i in range(60)]},
        "toy_small/task.json": {"name": "toy_small", "examples": [gen(i) for i in range(5)]},
        "toy_parent/task.json": {"name": "toy_parent"},
        "toy_parent/sub_a/task.json": {"name": "sub_a", "examples": [gen(i) for i in range(40)]},
        "logical_deduction/task.json": {"name": "logical_deduction"},
        "logical_deduction/three_objects/task.json": {"name": "three_objects", "examples": [mc(i) for i in range(20)]},
        "word_sorting/task.json": {"name": "word_sorting", "examples": [gen(i, long=True) for i in range(10)]},
        "toy_prog/task.py": "print('programmatic tasks are not read')",
        "broken/task.json": "{not json",
        **(extra or {}),
    }
    with tarfile.open(path, "w:gz") as tf:
        for name, content in files.items():
            data = (content if isinstance(content, str) else json.dumps(content)).encode()
            info = tarfile.TarInfo(f"{PREFIX}/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bb")
    archive = make_archive(tmp / "bigbench-1.0.0.tar.gz")
    out = tmp / "cache"
    res = subprocess.run([sys.executable, "-m", "scripts.bigbench_suite", "--archive", str(archive), "--out", str(out),
                          "--skip-checksum", "--jsonl-out", str(tmp / "train.jsonl")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    return out, tmp / "train.jsonl", res.stdout


def test_the_held_out_sources_are_the_big_bench_hard_ones():
    assert set(BBH_SOURCES) == PINNED_BBH


def test_the_script_builds_the_suite_from_the_archive(built):
    out, _, stdout = built
    tasks = {t.id: t for t in bigbench.load_cache(out)}
    # toy_long (nothing fits the context), toy_small (too few) and the example-less parents are not tasks
    assert set(tasks) == {"bb-toy_gen", "bb-toy_mc", "bb-toy_parent.sub_a", "bb-logical_deduction.three_objects",
                          "bb-word_sorting"}
    assert "held out" in stdout
    g = tasks["bb-toy_gen"]
    assert g.kind == "generative" and not g.heldout
    assert all(r["output"] == r["targets"][0] and len(r["targets"]) == 2 for r in g.rows)
    m = tasks["bb-toy_mc"]
    assert m.kind == "multiple_choice" and len(m.rows) == 50  # the duplicate input is dropped
    r0 = next(r for r in m.rows if r["input"].startswith("question 0?"))
    assert r0["output"] == "yes 0" and sorted(r0["choices"]) == ["maybe", "no 0", "yes 0"]
    assert r0["input"] == "question 0?\nOptions:\n" + "\n".join(f"- {c}" for c in r0["choices"])
    # held-out tasks are kept whole, long inputs included, subtasks included
    assert tasks["bb-word_sorting"].heldout and len(tasks["bb-word_sorting"].rows) == 10
    assert tasks["bb-logical_deduction.three_objects"].heldout


def test_splits_are_fixed_and_disjoint(built):
    out, _, _ = built
    for t in bigbench.load_cache(out):
        by_split = {s: {r["input"] for r in t.split_rows(s)} for s in bigbench.SPLITS}
        assert sum(map(len, by_split.values())) == len(t.rows)
        # a hash of the example as the task file gives it (options in its order), not as shown
        for r in t.rows:
            question, _, _ = r["input"].partition("\nOptions:\n")
            original = next(ex for ex in (mc(i) for i in range(50)) if ex["input"] == question) if r.get("choices") \
                else None
            key = bigbench.with_options(question, list(original["target_scores"])) if original else r["input"]
            assert r["split"] == bigbench.split_of(t.id, key)
    rows = [r for t in bigbench.load_cache(out) for r in t.rows]
    assert {r["split"] for r in rows} == set(bigbench.SPLITS)


def test_training_never_sees_a_held_out_task_or_subtask(built):
    out, jsonl, _ = built
    train = bigbench.training_suite(500, out)
    assert set(train) == {"bb-toy_gen", "bb-toy_mc", "bb-toy_parent.sub_a"}
    assert all(ex.task in train for exs in train.values() for ex in exs)
    written = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert {r["task"] for r in written} == set(train)
    assert not any(r["task"].split(".")[0].removeprefix("bb-") in BBH_SOURCES for r in written)
    tasks = bigbench.load_cache(out)
    assert all(t.heldout == (t.source in BBH_SOURCES) for t in tasks)


def test_a_wrong_archive_is_refused_and_a_missing_cache_names_the_command(tmp_path):
    archive = make_archive(tmp_path / "bigbench-1.0.0.tar.gz")
    with pytest.raises(ValueError, match="not the bigbench 1.0.0 sdist"):
        bigbench.build_cache(archive, tmp_path / "c")
    assert not (tmp_path / "c" / "tasks.json").exists()
    with pytest.raises(FileNotFoundError, match="scripts.bigbench_suite"):
        bigbench.load_cache(tmp_path / "nothing")


def test_the_real_suite_when_built_here():
    """On a machine that built the suite from the real sdist: its held-out tasks are the pinned ones."""
    try:
        tasks = bigbench.load_cache()
    except FileNotFoundError:
        pytest.skip("no BIG-bench suite built here (python -m scripts.bigbench_suite)")
    held = [t for t in tasks if t.heldout]
    assert len(held) == REAL_HELDOUT_COUNT and len({t.source for t in held}) == REAL_HELDOUT_SOURCES
    assert not [t.id for t in tasks if not t.heldout and t.source in BBH_SOURCES]
    assert not [t.id for t in held if t.source not in BBH_SOURCES]


def answer_places(rows: list[dict]) -> dict[int, int]:
    places: dict[int, int] = {}
    for r in rows:
        if r.get("choices"):
            shown = r["input"].split("\nOptions:\n", 1)[1].split("\n")
            assert shown == [f"- {c}" for c in r["choices"]]  # the input lists the choices as stored
            i = r["choices"].index(r["output"])
            places[i] = places.get(i, 0) + 1
    return places


def test_the_right_answer_is_not_always_the_first_option(built):
    """The task files list the right answer first (mc() here; date_understanding and
    temporal_sequences in the real archive): 16 examples teach that, not the task."""
    out, _, _ = built
    mc_rows = [r for t in bigbench.load_cache(out) if t.kind == "multiple_choice" for r in t.rows]
    places = answer_places(mc_rows)
    assert len(places) == 3 and max(places.values()) < 0.6 * len(mc_rows), places
    again = bigbench.convert_example("bb-toy_mc", mc(7))
    assert again == bigbench.convert_example("bb-toy_mc", mc(7))  # the same order every build


def test_no_held_out_task_of_the_real_suite_keeps_its_answer_in_one_place():
    try:
        tasks = bigbench.load_cache()
    except FileNotFoundError:
        pytest.skip("no BIG-bench suite built here (python -m scripts.bigbench_suite)")
    for t in tasks:
        if t.heldout and t.kind == "multiple_choice":
            places = answer_places(list(t.rows))
            n_choices = len(t.rows[0]["choices"])
            assert max(places.values()) <= max(0.75, 2.0 / n_choices) * len(t.rows), (t.id, places)


def _task(tid: str, source: str, train_rows: int, heldout: bool = False) -> bigbench.BBTask:
    rows = tuple({"input": f"{tid} {i}", "output": "o", "split": "train"} for i in range(train_rows))
    rows += ({"input": f"{tid} valid", "output": "o", "split": "valid"},) * 50  # other splits do not count
    return bigbench.BBTask(tid, source, "generative", heldout, rows)


def test_one_task_per_source_keeps_each_sources_largest_training_task():
    tasks = [_task("bb-multi.b", "multi", 30), _task("bb-multi.a", "multi", 40), _task("bb-multi.c", "multi", 40),
             _task("bb-solo", "solo", 5), _task("bb-pair.x", "pair", 10), _task("bb-pair.y", "pair", 11)]
    kept = bigbench.one_task_per_source(tasks)
    assert [t.id for t in kept] == ["bb-multi.a", "bb-pair.y", "bb-solo"]  # a tie keeps the first id


def test_the_script_writes_one_task_per_source(tmp_path):
    # toy_parent gets a second, smaller subtask: the flag must keep sub_a and leave sub_b out
    archive = make_archive(tmp_path / "bigbench-1.0.0.tar.gz",
                           {"toy_parent/sub_b/task.json": {"name": "sub_b", "examples": [gen(i) for i in range(36)]}})
    path, cache = tmp_path / "one.jsonl", tmp_path / "cache"
    res = subprocess.run([sys.executable, "-m", "scripts.bigbench_suite", "--archive", str(archive),
                          "--out", str(cache), "--skip-checksum", "--jsonl-out", str(path), "--one-per-source"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    written = Counter(json.loads(line)["task"] for line in path.read_text().splitlines())
    every = bigbench.training_suite(500, cache)
    assert {"bb-toy_parent.sub_a", "bb-toy_parent.sub_b"} <= set(every)
    assert set(written) == set(every) - {"bb-toy_parent.sub_b"}
    assert written == {tid: len(every[tid]) for tid in written}


def test_a_training_row_whose_input_is_a_real_tasks_is_left_out(tmp_path):
    # BIG-bench asks past tenses of common verbs, as the real past-tense task does: the training suite
    # must not hold them, however they are cased or spaced, so a real task is never scored on training
    from training.real_tasks import PAIRS
    verb, past = PAIRS["past-tense"][-1]
    rows = [{"input": f" {verb.upper()} ", "target": [past]}, {"input": f"{verb}  {verb}", "target": ["x"]}]
    rows += [gen(i) for i in range(40)]
    archive = make_archive(tmp_path / "bigbench-1.0.0.tar.gz",
                           {"toy_verbs/task.json": {"name": "toy_verbs", "examples": rows}})
    cache = tmp_path / "cache"
    bigbench.write_cache(bigbench.convert(archive), cache, "unchecked")
    every = [e.input for exs in bigbench.training_suite(500, cache).values() for e in exs]
    cached = [e.input for task in bigbench.load_cache(cache) for e in task.examples("train")]
    assert verb.upper() in cached  # a training row of the cache (stripped), so the suite dropped it
    assert verb.upper() not in every and f"{verb}  {verb}" in every
