"""The README's first registration uses docs/examples/first-two-upper.jsonl: a file the CLI
reads, with enough examples for the server's default minimum, and answers that are right."""

from __future__ import annotations

from pathlib import Path

from client._core import load_jsonl, validate_examples
from server.wiring.settings import Settings
from training.suite import parse_task

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "first-two-upper.jsonl"


def test_the_readme_registers_the_example_file():
    readme = (ROOT / "README.md").read_text()
    assert "--examples docs/examples/first-two-upper.jsonl" in readme


def test_the_example_file_is_a_registration_the_server_takes():
    rows = validate_examples(load_jsonl(EXAMPLE), "first-two-upper")
    assert len(rows) >= Settings.model_fields["min_examples_per_task"].default
    assert len({r["input"] for r in rows}) == len(rows)
    spec = parse_task("first2.upper")  # what its description says: the first two words, in capitals
    assert all(spec.apply(r["input"]) == r["output"] for r in rows)
