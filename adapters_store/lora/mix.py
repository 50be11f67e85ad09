"""Per-request task mixes: `mix:ID=W,ID=W,...` parsed, validated, and combined. Pure functions.

A mix of routed tasks t_1..t_P with weights W_i > 0 serves the adapter of the mixed routing
weights. With λ_i = W_i / sum_j W_j and w_i (L, h, S) the inference weights of task t_i (each
head's row over the S skills sums to 1, routing.eval_weights):

    w_mix[l, k, :] = sum_i λ_i * w_i[l, k, :]           # per layer l, per head k; still sums to 1

and, since the combine (combine.materialize) is linear in w, the served adapter is the weighted
sum of the tasks' adapters, factor by factor:

    A_mix = sum_i λ_i A_{t_i}          B_mix = sum_i λ_i B_{t_i}
    y = base(x) + x @ A_mix @ B_mix * scale

Note: this is not the weighted sum of the tasks' weight deltas (sum_i λ_i A_{t_i} B_{t_i}): the
product has cross terms λ_i λ_j A_{t_i} B_{t_j}. Mixing the rows keeps the mix a point of the
routing simplex (a task the inventory could have learned), costs one (L, h, S) sum, and is served
exactly like a single task (one row of weights written into the row's tables at admission).

Mixing the weights, not the logits: logits are not comparable across tasks after the sigmoid's
saturation, and a mix of logits with weight 1.0 on a task is that task only by accident of the
normalisation; a mix of weights is the task exactly.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from adapters_store.store.ids import RESERVED_TASK_IDS, TASK_ID_RE

MIX_PREFIX = "mix:"
MAX_MIX_PARTS = 8
# a weight: a decimal number > 0 (a non-zero digit somewhere), at most 8 digits each side, exponent 2
WEIGHT_PATTERN = (r"(?:[0-9]{0,8}[1-9][0-9]{0,8}(?:\.[0-9]{0,8})?|[0-9]{0,8}\.[0-9]{0,8}[1-9][0-9]{0,8})"
                  r"(?:e[-+]?[0-9]{1,2})?")
_ID = r"[a-z0-9][a-z0-9._-]{0,63}"
_PART = rf"{_ID}={WEIGHT_PATTERN}"
MAX_MIX_CHARS = len(MIX_PREFIX) + MAX_MIX_PARTS * (64 + 1 + 30 + 1)
# what the wire schemas accept as a model / task id: a task id, or a mix; what no regex says (a task
# named twice, `base` in a mix) is refused by parse_mix (the OpenAPI document states it as a `not`)
MODEL_ID_PATTERN = rf"^({_ID}|mix:{_PART}(,{_PART}){{0,{MAX_MIX_PARTS - 1}}})$"
MIX_REFUSED_PATTERN = r"^mix:(?:.*,)?(base=|([a-z0-9][a-z0-9._-]*)=[^,]*,(?:.*,)?\2=)"
MIX_SCHEMA_EXTRA: dict[str, Any] = {"not": {"pattern": MIX_REFUSED_PATTERN}}
_WEIGHT_RE = re.compile(WEIGHT_PATTERN)


class MixError(ValueError):
    """A malformed mix id (the message names the part at fault, never echoes the whole input)."""


@dataclass(frozen=True)
class Mix:
    """parts: (task id, normalised weight λ) sorted by id; the λ sum to 1."""

    parts: tuple[tuple[str, float], ...]

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(t for t, _ in self.parts)

    @property
    def weights(self) -> tuple[float, ...]:
        return tuple(w for _, w in self.parts)

    @property
    def canonical(self) -> str:
        """One spelling per mix (sorted ids, normalised weights): `mix:a=0.7,b=0.3` and
        `mix:b=3,a=7` are the same mix, and share cache entries."""
        return MIX_PREFIX + ",".join(f"{t}={w!r}" for t, w in self.parts)


def is_mix(task: str) -> bool:
    return isinstance(task, str) and task.startswith(MIX_PREFIX)


def parse_mix(text: str) -> Mix:
    """`mix:ID=W,ID=W,...` -> Mix. Raises MixError: not a mix, more than MAX_MIX_PARTS parts, a
    malformed part, a bad id (or `base`), a weight that is not a finite number > 0, a duplicate id."""
    if not is_mix(text):
        raise MixError(f"a mix starts with {MIX_PREFIX!r}")
    if len(text) > MAX_MIX_CHARS:
        raise MixError(f"a mix has at most {MAX_MIX_CHARS} characters")
    body = text[len(MIX_PREFIX):]
    pieces = body.split(",")
    if len(pieces) > MAX_MIX_PARTS:
        raise MixError(f"a mix has at most {MAX_MIX_PARTS} parts, got {len(pieces)}")
    raw: dict[str, float] = {}
    for n, piece in enumerate(pieces, 1):
        task, sep, weight = piece.partition("=")
        if not sep:
            raise MixError(f"mix part {n} must be ID=WEIGHT")
        if TASK_ID_RE.fullmatch(task) is None:
            raise MixError(f"mix part {n}: task id must match {TASK_ID_RE.pattern}")
        if task in RESERVED_TASK_IDS:
            raise MixError(f"mix part {n}: {task!r} is not a routed task")
        if _WEIGHT_RE.fullmatch(weight) is None:
            raise MixError(f"mix part {n} ({task}): weight must be a decimal number > 0 (at most 8 digits "
                           "either side of the point)")
        value = float(weight)
        if not math.isfinite(value) or value <= 0:
            raise MixError(f"mix part {n} ({task}): weight must be a finite number > 0")
        if task in raw:
            raise MixError(f"mix part {n}: task {task!r} appears twice")
        raw[task] = value
    total = math.fsum(raw.values())
    if not math.isfinite(total):
        raise MixError("mix weights overflow")
    return Mix(tuple((t, raw[t] / total) for t in sorted(raw)))


def mix_weights(weights: torch.Tensor, lambdas: torch.Tensor) -> torch.Tensor:
    """weights (P, L, h, S): the mixed tasks' inference weights; lambdas (P,) summing to 1
    -> (L, h, S):  w_mix = sum_i lambdas[i] * weights[i]."""
    if weights.dim() != 4 or lambdas.shape != (weights.shape[0],):
        raise ValueError(f"shape mismatch: weights {tuple(weights.shape)}, lambdas {tuple(lambdas.shape)}")
    return torch.einsum("p,plks->lks", lambdas.to(weights.dtype), weights)
