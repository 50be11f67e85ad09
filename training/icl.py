"""In-context learning: what a user with no adapter does with k examples (the baseline every
registration method is weighed against, docs/RESULTS.md).

The examples go before the query in the same prompt format a task is trained and served with, one
solved example after another, so the bare backbone sees what the task looks like:

>>> from training.data import Example
>>> icl_context([Example("t", "cat 3", "CAT 3")])
'Input: cat 3\\nOutput: CAT 3\\n\\n'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from adapters_store.backbone.prompt import format_prompt, format_target
from training.data import Example


def icl_context(demonstrations: Sequence[Example]) -> str:
    """The demonstrations, each as prompt + answer, separated by a blank line."""
    return "".join(format_prompt(d.input) + format_target(d.output) + "\n\n" for d in demonstrations)


def icl_max_length(model: Any) -> int:
    """How long an in-context prompt may be: the backbone's whole context window. A user sends all k
    demonstrations as one fixed prefix; a tighter limit would cut each row's prompt at a different
    place, so rows would see different demonstrations and share no cache
    (training.evaluate.shared_prompt)."""
    return int(model.config.max_position_embeddings)
