"""The far held-out set: compositions of the suite's primitives that no training task comes near.

build_suite's 16 held-out tasks recombine primitives in ways the training suite nearly covers: the
nearest training task of the reference suite (REFERENCE_PAIRS/TRIPLES) agrees with some of them on
half of all random inputs. FAR_HELDOUT are compositions on which its nearest agrees on at most FAR_BOUND
of the fixed random inputs `agreement_inputs()`: a model can only get them right by composing
skills anew. scripts/far_heldout.py chose them (its docstring says how) and prints the figures;
tests/training/test_far_heldout.py fails if one of them enters the training suite or the bound stops holding.

Agreement of two tasks = the share of inputs on which their outputs are equal (exact match).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence

import numpy as np

from training.suite import Suite, TaskSpec, build_suite, candidate_pool, parse_task, random_input

FAR_BOUND = 0.30
N_AGREEMENT_INPUTS = 1000
AGREEMENT_SEED = 7
#: the suite the far set was chosen against and the held-out bounds are measured on
#: (scripts/wide_suite.py --pairs 100 --triples 92: stage 2 of the shipped inventory)
REFERENCE_PAIRS, REFERENCE_TRIPLES = 100, 92
#: the widest suite the shipped inventory was trained on
WIDE_PAIRS, WIDE_TRIPLES = 103, 381

#: chosen by scripts/far_heldout.py (its --check says whether it still chooses these)
FAR_HELDOUT: tuple[str, ...] = (
    "title.plural",
    "rotate.swap-ends",
    "double.sum",
    "rev-words.swap-ends",
    "rotate.rotate.rotate",
    "inc.double.sum",
    "rev-words.upper.first2",
    "swap-ends.plural.rev-chars",
    "title.rev-chars.caesar",
    "rev-words.first2.plural",
    "rotate.swap-ends.rev-chars",
    "upper.last2.plural",
    "last2.caesar.caesar",
    "title.sort.rev-words",
    "double.sort.inc",
    "inc.inc.inc",
)


def wide_suite(pairs: int = WIDE_PAIRS, triples: int = WIDE_TRIPLES) -> Suite:
    """build_suite with more training pairs and triples (the same 16 held-out tasks), never a far task,
    nor a composition nearer than FAR_BOUND to one, nor one nearer to a held-out task than the
    reference suite comes: however wide the suite, both held-out sets stay as far from it as from that one."""
    exclude = frozenset(FAR_HELDOUT) | near_far() | near_heldout()
    return build_suite(0, n_pairs=(pairs, 8), n_triples=(triples, 8), exclude=exclude)


@functools.cache
def near_heldout() -> frozenset[str]:
    """Compositions of the pool that agree with one of build_suite's 16 held-out tasks on more of
    `agreement_inputs()` than the nearest training task of the reference suite does. Without this a
    wider suite draws near-copies of them (dedupe.first2.rev-chars is first2.rev-chars on every
    input without a repeated word) and the held-out composition protocol would measure recall
    instead of composition, not comparably across inventories."""
    held = build_suite(0).heldout_tasks
    reference = build_suite(0, n_pairs=(REFERENCE_PAIRS, 8), n_triples=(REFERENCE_TRIPLES, 8)).train_tasks
    bounds = np.array([share for share, _ in nearest(held, reference, agreement_inputs())])
    return _near(held, bounds)


def _near(tasks: Sequence[TaskSpec], bound: float | np.ndarray) -> frozenset[str]:
    """Compositions of the pool (other than `tasks`) that agree with some task i of `tasks` on more
    than bound (or bound[i]) of `agreement_inputs()`."""
    names = {t.name for t in tasks}
    pool = [t for t in candidate_pool() if t.name not in names]
    ids: dict[str, int] = {}
    agree = agreement_matrix(output_table(pool, agreement_inputs(), ids), output_table(tasks, agreement_inputs(), ids))
    return frozenset(t.name for t, row in zip(pool, agree > bound, strict=True) if row.any())


@functools.cache
def near_far() -> frozenset[str]:
    """Compositions of the suite's pool that agree with some far held-out task on more than FAR_BOUND
    of `agreement_inputs()`: training on one would make that task no longer far."""
    return _near(far_tasks(), FAR_BOUND)


def far_tasks() -> list[TaskSpec]:
    return [parse_task(name) for name in FAR_HELDOUT]


def agreement_inputs(n: int = N_AGREEMENT_INPUTS, seed: int = AGREEMENT_SEED) -> list[str]:
    rng = random.Random(seed)
    return [random_input(rng, "legacy") for _ in range(n)]  # the bounds were set on the legacy words


def output_table(tasks: Sequence[TaskSpec], inputs: Sequence[str], ids: dict[str, int] | None = None) -> np.ndarray:
    """(len(tasks), len(inputs)) int64: each output string as an id (pass one `ids` to compare tables)."""
    ids = {} if ids is None else ids
    return np.array([[ids.setdefault(t.apply(x), len(ids)) for x in inputs] for t in tasks], dtype=np.int64)


def agreement_matrix(a: np.ndarray, b: np.ndarray, chunk: int = 64) -> np.ndarray:
    """(len(a), len(b)) share of inputs on which row i of a and row j of b have the same output."""
    out = np.empty((a.shape[0], b.shape[0]))
    for i in range(0, a.shape[0], chunk):
        out[i:i + chunk] = (a[i:i + chunk, None, :] == b[None, :, :]).mean(-1)
    return out


def nearest(tasks: Sequence[TaskSpec], others: Sequence[TaskSpec], inputs: Sequence[str]) -> list[tuple[float, str]]:
    """For each task, (agreement, name) of the task in `others` that agrees with it on the most inputs."""
    ids: dict[str, int] = {}
    agree = agreement_matrix(output_table(tasks, inputs, ids), output_table(others, inputs, ids))
    return [(float(row.max()), others[int(row.argmax())].name) for row in agree]
