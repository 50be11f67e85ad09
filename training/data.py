"""Task examples: the JSONL format, its loader, and small helpers.

One JSON object per line::

    {"task": "rev-words.upper", "input": "cat dog 3", "output": "3 DOG CAT"}

``"task"`` may be omitted when the caller says which task the file holds
(``load_jsonl(path, task="rev-words.upper")``). Blank lines are skipped;
other keys are ignored.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from adapters_store.store.ids import validate_task_id

_FIELDS = ("task", "input", "output")


class DataError(ValueError):
    """A malformed example file; the message names the file, line and field."""


@dataclass(frozen=True)
class Example:
    """One supervised example of one task.

    >>> Example("upper", "cat 3", "CAT 3").output
    'CAT 3'
    """

    task: str
    input: str
    output: str

    def to_dict(self) -> dict[str, str]:
        return {"task": self.task, "input": self.input, "output": self.output}


def _parse_line(line: str, where: str, task: str | None, max_field_chars: int) -> Example:
    """Parse and validate one non-blank JSONL line; ``where`` is ``"file:line"`` for messages."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "task" not in obj and task is not None:
        obj = {**obj, "task": task}
    values: dict[str, str] = {}
    for field in _FIELDS:
        if field not in obj:
            raise DataError(f"{where}: missing field {field!r}")
        value = obj[field]
        if not isinstance(value, str):
            raise DataError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
        if not value.strip():
            raise DataError(f"{where}: field {field!r} is empty")
        if len(value) > max_field_chars:
            raise DataError(f"{where}: field {field!r} has {len(value)} chars, over the cap of {max_field_chars}")
        values[field] = value
    try:
        validate_task_id(values["task"])
    except ValueError as e:
        raise DataError(f"{where}: field 'task': {e}") from None
    if task is not None and values["task"] != task:
        raise DataError(f"{where}: field 'task' is {values['task']!r} but this file was loaded as task {task!r}")
    return Example(**values)


def load_jsonl(
    path: str | Path,
    task: str | None = None,
    max_examples: int | None = None,
    max_field_chars: int = 4096,
) -> list[Example]:
    """Load and validate examples from a JSONL file.

    ``task``: the task every line belongs to (lines may then omit ``"task"``;
    a line naming another task is an error). ``max_examples``: stop after that
    many examples. Raises :class:`DataError` (a ``ValueError``) naming the file,
    the 1-based line number and the field at fault.
    """
    path = Path(path)
    if task is not None:
        try:
            validate_task_id(task)
        except ValueError as e:
            raise DataError(f"{path}: {e}") from None
    if max_examples is not None and max_examples < 0:
        raise ValueError(f"max_examples must be >= 0, got {max_examples}")
    out: list[Example] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if max_examples is not None and len(out) >= max_examples:
                break
            if not line.strip():
                continue
            out.append(_parse_line(line, f"{path}:{lineno}", task, max_field_chars))
    return out


def write_jsonl(examples: Iterable[Example], path: str | Path) -> Path:
    """Write examples as JSONL (creating parent directories); returns the path.

    The output round-trips through :func:`load_jsonl`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps(ex.to_dict(), ensure_ascii=False) + "\n")
    return path


def group_by_task(examples: Iterable[Example]) -> dict[str, list[Example]]:
    """Group examples by task, keeping first-seen task order and example order.

    >>> g = group_by_task([Example("a", "x", "y"), Example("b", "x", "z"), Example("a", "u", "v")])
    >>> {k: len(v) for k, v in g.items()}
    {'a': 2, 'b': 1}
    """
    groups: dict[str, list[Example]] = {}
    for ex in examples:
        groups.setdefault(ex.task, []).append(ex)
    return groups


def split_examples(
    examples: list[Example], holdout_fraction: float, seed: int
) -> tuple[list[Example], list[Example]]:
    """Deterministically split into ``(train, held)``, each keeping the original order.

    ``held`` gets ``round(len * holdout_fraction)`` examples, clamped so both
    sides keep at least one when there are at least two examples and the
    fraction is positive. A fraction of 0 holds nothing out.

    >>> exs = [Example("a", str(i), str(i)) for i in range(10)]
    >>> train, held = split_examples(exs, 0.2, seed=0)
    >>> len(train), len(held)
    (8, 2)
    >>> split_examples(exs[:2], 0.01, seed=0)[1] != []
    True
    """
    if not 0.0 <= holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in [0, 1), got {holdout_fraction}")
    n = len(examples)
    n_held = round(n * holdout_fraction)
    if holdout_fraction > 0 and n >= 2:
        n_held = min(max(n_held, 1), n - 1)
    elif n < 2:
        n_held = 0
    order = list(range(n))
    random.Random(seed).shuffle(order)
    held_idx = set(order[:n_held])
    train = [ex for i, ex in enumerate(examples) if i not in held_idx]
    held = [ex for i, ex in enumerate(examples) if i in held_idx]
    return train, held
