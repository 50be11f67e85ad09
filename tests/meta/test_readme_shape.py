"""The README stays a few screens: at most 400 lines, and every table row a sentence (at most 200
characters). What does not fit goes to a page under docs/ (docs/tuning.md, docs/fleet.md, ...)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 400
MAX_ROW = 200


def long_rows(text: str, limit: int = MAX_ROW) -> list[str]:
    """Table rows (lines starting with ``|``) longer than ``limit`` characters, cut for the message."""
    return [line[:60] + "..." for line in text.splitlines()
            if line.lstrip().startswith("|") and len(line) > limit]


def test_the_readme_is_at_most_400_lines() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, f"README.md is {len(lines)} lines; move sections to docs/"


def test_every_readme_table_row_is_at_most_200_characters() -> None:
    rows = long_rows((ROOT / "README.md").read_text(encoding="utf-8"))
    assert not rows, f"README.md table rows over {MAX_ROW} characters: {rows}"


def test_a_long_row_is_caught() -> None:
    text = "| `A` | 1 | short |\n" + "| `B` | 2 | " + "x" * 200 + " |\nnot a row " + "y" * 300
    assert long_rows(text) == ["| `B` | 2 | " + "x" * 48 + "..."]


def test_every_setting_is_documented_in_the_readme_or_the_tuning_page() -> None:
    """A user setting has a row of the README's configuration table; an internal switch a section of
    docs/tuning.md. A field in neither is a setting nobody can find."""
    from server.wiring.settings import Settings

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = "\n".join(line for line in readme.splitlines() if line.startswith("| `POLYSERVE_"))
    tuning = (ROOT / "docs" / "tuning.md").read_text(encoding="utf-8")
    prefix = Settings.model_config.get("env_prefix", "").upper()
    missing = [name for name in (f"{prefix}{field}".upper() for field in Settings.model_fields)
               if f"`{name}`" not in rows and name not in tuning]
    assert not missing, f"settings with no README row and no docs/tuning.md entry: {missing}"
