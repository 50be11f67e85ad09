"""Task (adapter) identifiers.

A task id names one LoRA adapter. It is used as a directory name in the
adapter store, as a URL path segment and as the ``model``/route key in
requests, so it is deliberately restricted to a small, filesystem- and
URL-safe alphabet.

>>> validate_task_id("rev-words.upper")
'rev-words.upper'
>>> validate_task_id("../x")
Traceback (most recent call last):
...
ValueError: task id '../x' must match ^[a-z0-9][a-z0-9._-]{0,63}$
"""

from __future__ import annotations

import re

TASK_ID_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"
TASK_ID_RE = re.compile(TASK_ID_PATTERN)

#: Ids with a meaning of their own (``base`` = the frozen backbone, no adapter).
RESERVED_TASK_IDS: frozenset[str] = frozenset({"base"})


def validate_task_id(task: str) -> str:
    """Return ``task`` unchanged if it is a well-formed task id, else raise ``ValueError``.

    Lowercase letters, digits, ``.``, ``_`` and ``-``; first character a letter
    or digit; 1 to 64 characters.

    >>> validate_task_id("task-0")
    'task-0'
    """
    # fullmatch, not match: with match, "$" would also accept a trailing newline.
    if not isinstance(task, str) or TASK_ID_RE.fullmatch(task) is None:
        raise ValueError(f"task id {task!r} must match {TASK_ID_PATTERN}")
    return task


def validate_new_task_id(task: str) -> str:
    """Like :func:`validate_task_id`, but also refuse reserved ids (for creating adapters).

    >>> validate_new_task_id("base")
    Traceback (most recent call last):
    ...
    ValueError: task id 'base' is reserved
    """
    validate_task_id(task)
    if task in RESERVED_TASK_IDS:
        raise ValueError(f"task id {task!r} is reserved")
    return task
