"""A task's demonstrations: some of its own examples, placed before every prompt it serves.

A task may carry demonstrations beside its adapter (or instead of one: `demos` serves them on the
bare backbone). They are the task's first examples, in the order the user sent them, for as long
as their text fits a budget of tokens (POLYSERVE_MAX_DEMONSTRATION_TOKENS), each in the task's
prompt format (training.icl):

>>> from training.data import Example
>>> demonstration_text([Example("t", "France", "Paris"), Example("t", "Peru", "Lima")])
'Input: France\\nOutput: Paris\\n\\nInput: Peru\\nOutput: Lima\\n\\n'

An example that is itself a demonstration never sees its own answer in its context: training
(`demos+routing`) and leave-one-out scoring give it the other demonstrations (`context_for`).
Serving puts all of them before a new input.

After demonstrations the backbone ends an answer as they do, with a blank line, not with its end
token: an answer ends at its first newline (ANSWER_END; serving adds it as a stop string, and
scoring accepts any token that begins with it as the answer's end: `end_ids`). A task whose
outputs span lines therefore carries no demonstrations (`fits_on_a_line`).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from adapters_store.backbone.prompt import demonstration_token_ids
from training.data import Example
from training.icl import icl_context

DEFAULT_DEMONSTRATION_TOKENS = 1024
MAX_DEMONSTRATIONS = 64  # whatever the budget: a prompt of more examples than this is a training set
ANSWER_END = "\n"
_END_IDS: dict[int, frozenset[int]] = {}
_end_lock = threading.Lock()


def demonstration_text(demonstrations: Sequence[Example]) -> str:
    """The text placed before a prompt: each demonstration as prompt + answer, then a blank line."""
    return icl_context(demonstrations)


def select_demonstrations(examples: Sequence[Example], tokenizer: Any, budget_tokens: int) -> list[Example]:
    """The examples, from the first, whose demonstration text fits `budget_tokens` tokens (at most
    MAX_DEMONSTRATIONS). An example too long to fit is skipped, not cut: a demonstration is shown
    whole or not at all. Empty when none fits (or the budget is 0)."""
    if budget_tokens < 0:
        raise ValueError(f"budget_tokens must be >= 0, got {budget_tokens}")
    chosen: list[Example] = []
    used = 0
    for ex in examples:
        if len(chosen) == MAX_DEMONSTRATIONS:
            break
        cost = len(demonstration_token_ids(tokenizer, demonstration_text([ex]), special_tokens=False))
        if used + cost <= budget_tokens:
            chosen.append(ex)
            used += cost
    return chosen


def context_for(example: Example, demonstrations: Sequence[Example]) -> str:
    """The demonstrations an example is trained or scored with: all of them but itself (by
    identity: a repeated pair sent twice is two examples)."""
    return demonstration_text([d for d in demonstrations if d is not example])


def fits_on_a_line(examples: Sequence[Example]) -> bool:
    """Whether every answer ends before ANSWER_END: only then can demonstrations serve the task."""
    return all(ANSWER_END not in ex.output for ex in examples)


def end_ids(tokenizer: Any) -> frozenset[int]:
    """The tokens that end an answer after demonstrations: the end token, and every token whose
    text begins with ANSWER_END (worked out once per tokenizer)."""
    key = id(tokenizer)
    with _end_lock:
        if key in _END_IDS:
            return _END_IDS[key]
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    for token_id in range(len(tokenizer)):
        if tokenizer.decode([token_id]).startswith(ANSWER_END):
            ids.add(token_id)
    with _end_lock:
        _END_IDS[key] = frozenset(ids)
    return _END_IDS[key]


def as_pairs(demonstrations: Sequence[Example]) -> list[dict[str, str]]:
    """The stored form (a task record's `demonstrations`)."""
    return [{"input": d.input, "output": d.output} for d in demonstrations]


def majority_hits(examples: Sequence[Example]) -> list[bool]:
    """Leave-one-out score of always answering the most common output: each example against the
    majority of the others (ties: the answer seen first). The floor every form should clear."""
    hits = []
    for i, ex in enumerate(examples):
        others = Counter(e.output for j, e in enumerate(examples) if j != i)
        if not others:
            hits.append(False)
            continue
        top = max(others.values())
        first = next(e.output for j, e in enumerate(examples) if j != i and others[e.output] == top)
        hits.append(first == ex.output)
    return hits
