"""Example files, task ids and the shared prompt format (training/data.py, adapters_store/store/ids.py)."""

from __future__ import annotations

import json

import pytest

from adapters_store.backbone.prompt import PROMPT_TEMPLATE, format_prompt, format_target, strip_separator
from adapters_store.store.ids import RESERVED_TASK_IDS, TASK_ID_RE, validate_new_task_id, validate_task_id
from training.data import DataError, Example, group_by_task, load_jsonl, split_examples, write_jsonl

# --- task ids ---------------------------------------------------------------------------------


@pytest.mark.parametrize("good", ["a", "rev-words.upper", "task-0", "0", "a_b", "x" * 64])
def test_valid_task_ids(good):
    assert validate_task_id(good) == good
    assert TASK_ID_RE.match(good)


@pytest.mark.parametrize("bad", ["../x", "", "x" * 65, "Upper", "a/b", ".a", "-a", "a b", "a\n", "é"])
def test_invalid_task_ids(bad):
    with pytest.raises(ValueError) as e:
        validate_task_id(bad)
    assert repr(bad) in str(e.value)
    assert "must match" in str(e.value)


def test_reserved_ids():
    assert "base" in RESERVED_TASK_IDS
    assert validate_task_id("base") == "base"
    with pytest.raises(ValueError, match="reserved"):
        validate_new_task_id("base")
    with pytest.raises(ValueError, match="must match"):
        validate_new_task_id("../x")
    assert validate_new_task_id("rev-words.upper") == "rev-words.upper"


# --- prompt -----------------------------------------------------------------------------------


def test_prompt_format():
    assert PROMPT_TEMPLATE == "Input: {input}\nOutput:"
    assert format_prompt("cat 3") == "Input: cat 3\nOutput:"
    assert format_target("CAT 3") == " CAT 3"
    assert format_prompt("{x}") == "Input: {x}\nOutput:"
    assert strip_separator(format_target("CAT 3")) == "CAT 3"
    assert strip_separator("  two") == " two" and strip_separator("none") == "none"  # exactly one separator


# --- JSONL ------------------------------------------------------------------------------------

EXAMPLES = [
    Example("upper", "cat 3", "CAT 3"),
    Example("rev-words.upper", "cat dog", "DOG CAT"),
    Example("upper", "ünïcode \"quoted\"\tx", "ÜNÏCODE \"QUOTED\"\tX"),
]


def test_roundtrip(tmp_path):
    path = write_jsonl(EXAMPLES, tmp_path / "sub" / "ex.jsonl")
    assert load_jsonl(path) == EXAMPLES
    assert load_jsonl(path, max_examples=2) == EXAMPLES[:2]
    assert load_jsonl(path, max_examples=0) == []


def _write(tmp_path, lines: list[str]):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_task_argument(tmp_path):
    path = _write(tmp_path, [json.dumps({"input": "a", "output": "b"}), "",
                             json.dumps({"task": "t1", "input": "c", "output": "d"})])
    assert load_jsonl(path, task="t1") == [Example("t1", "a", "b"), Example("t1", "c", "d")]
    with pytest.raises(DataError, match=r"bad\.jsonl:1: missing field 'task'"):
        load_jsonl(path)
    with pytest.raises(DataError, match=r"bad\.jsonl:3: field 'task' is 't1'.*'t2'"):
        load_jsonl(path, task="t2")
    with pytest.raises(DataError, match="must match"):
        load_jsonl(path, task="../x")


GOOD = json.dumps({"task": "upper", "input": "cat", "output": "CAT"})


@pytest.mark.parametrize(
    ("bad_line", "pattern"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"task": "upper", "output": "X"}), "missing field 'input'"),
        (json.dumps({"task": "upper", "input": "x"}), "missing field 'output'"),
        (json.dumps({"task": "upper", "input": 3, "output": "X"}), "field 'input' must be a string"),
        (json.dumps({"task": "upper", "input": "x", "output": None}), "field 'output' must be a string"),
        (json.dumps({"task": "upper", "input": "", "output": "X"}), "field 'input' is empty"),
        (json.dumps({"task": "upper", "input": "x", "output": "  "}), "field 'output' is empty"),
        (json.dumps({"task": "upper", "input": "x" * 101, "output": "X"}), "field 'input' has 101 chars"),
        (json.dumps({"task": "../x", "input": "x", "output": "X"}), "field 'task'.*'../x'.*must match"),
        (json.dumps({"task": "Upper", "input": "x", "output": "X"}), "field 'task'.*must match"),
    ],
)
def test_rejects_bad_lines_with_line_number(tmp_path, bad_line, pattern):
    path = _write(tmp_path, [GOOD, "", bad_line, GOOD])
    with pytest.raises(DataError, match=rf"bad\.jsonl:3: {pattern}"):
        load_jsonl(path, max_field_chars=100)
    assert issubclass(DataError, ValueError)
    # stopping before the bad line never sees it
    assert load_jsonl(path, max_examples=1, max_field_chars=100) == [Example("upper", "cat", "CAT")]


# --- grouping and splitting -------------------------------------------------------------------


def test_group_by_task():
    groups = group_by_task(EXAMPLES)
    assert list(groups) == ["upper", "rev-words.upper"]
    assert groups["upper"] == [EXAMPLES[0], EXAMPLES[2]]


def _exs(n: int) -> list[Example]:
    return [Example("t", f"in {i}", f"out {i}") for i in range(n)]


@pytest.mark.parametrize(("n", "frac", "n_held"), [(10, 0.2, 2), (2, 0.01, 1), (2, 0.9, 1), (100, 0.1, 10),
                                                   (1, 0.5, 0), (0, 0.5, 0), (10, 0.0, 0)])
def test_split_sizes(n, frac, n_held):
    train, held = split_examples(_exs(n), frac, seed=0)
    assert len(held) == n_held and len(train) == n - n_held
    assert set(train).isdisjoint(held) and set(train) | set(held) == set(_exs(n))


def test_split_deterministic_and_ordered():
    exs = _exs(50)
    a = split_examples(exs, 0.3, seed=1)
    assert a == split_examples(exs, 0.3, seed=1)
    assert a != split_examples(exs, 0.3, seed=2)
    for part in a:
        assert part == sorted(part, key=exs.index)
    with pytest.raises(ValueError):
        split_examples(exs, 1.0, seed=0)
