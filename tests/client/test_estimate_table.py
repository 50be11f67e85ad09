"""`polyserve tasks show` prints an auto registration's estimate as a table."""

from __future__ import annotations

from client import _format as fmt
from client.types import Task


def test_the_estimate_is_a_table_with_the_chosen_form_marked():
    estimate = {"chosen": "demos", "level": 0.9, "note": "too few examples for an estimate: 8",
                "candidates": {"demos": {"exact": 0.875, "n": 8, "low": 0.59, "high": 0.98},
                               "routing": {"exact": 0.5, "n": 4, "low": 0.2, "high": 0.8,
                                           "stopped": "stopped after 4"}},
                "majority": {"exact": 0.25, "n": 8, "low": 0.08, "high": 0.55}}
    raw = {"id": "t", "status": "ready", "metrics": {"chosen": "demos", "estimate": estimate}}
    out = fmt.task_details(Task.from_json(raw))
    lines = out.splitlines()
    head = lines.index("estimate (cross-validated exact match, 90% interval):")
    rows = [line.split() for line in lines[head + 2 : head + 5]]
    assert rows[0] == ["demos", "0.88", "8", "0.59-0.98", "chosen"]
    assert rows[1] == ["routing", "0.50", "4", "0.20-0.80", "stopped"]
    assert rows[2][:5] == ["majority", "answer", "0.25", "8", "0.08-0.55"]
    assert lines[-1] == "too few examples for an estimate: 8"
    assert "candidates" not in out.split("estimate (")[0]  # the table, not the raw dict


def test_a_task_without_an_estimate_prints_as_before():
    raw = {"id": "t", "status": "ready", "metrics": {"eval_loss": 0.5}}
    assert "estimate" not in fmt.task_details(Task.from_json(raw))
