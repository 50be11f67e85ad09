"""The hyper-parameters of one few-shot adaptation (training/adapt.py), checked once when made.

An AdaptConfig holds what is configuration (method, budget, learning rate, batching, seeding,
held-out split, early stopping, precision); an Adaptation takes it with its collaborators (the
RoutedModel, the inventory, the examples, the tokenizer, a progress callback, a starting row).
Checks that need a collaborator (the examples, the model's layers, the starting row's shape)
stay with the Adaptation.

`steps`, `lr` and `batch_size` left as None mean the method's default (DEFAULTS); the
`resolved_*` properties give the values a run uses, and `budget(n)` the steps and held-out share
of a run on n examples (a routing run on many examples trains longer on all of them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from training.batching import FEW_SHOT_MAX_LENGTH
from training.precision import AUTOCAST_CHOICES

ADAPT_METHODS = ("routing", "mu", "full", "plain-lora")
SELECT_CHOICES = ("loss", "exact")
HOLDOUT = 0.25  # the share of the examples held out for early stopping, where any are
# Many examples: from LONG_FROM on, a routing registration (steps and held-out share left unset)
# holds none out and trains LONG_PASSES passes over them, at most LONG_MAX_STEPS steps: there the
# early stopping on a held-out quarter ended runs while the row was still learning the task; below
# LONG_FROM it is what keeps a few examples from being memorised (docs/RESULTS.md, "Many examples").
LONG_FROM = 64
LONG_PASSES = 12.5
LONG_MAX_STEPS = 400
# Routing: batches of 4 at lr 0.3 from a sweep on held-out compositions: smaller batches and more
# steps beat larger ones at the same examples seen and cost; a higher lr lowered the loss but lost
# exact match. 15 steps: within about one seed's spread of 30 steps' exact match at about half the
# time, which keeps a registration through the server within its time budget on the 2-core hosts measured
# (docs/RESULTS.md; docs/history/registration-recipes.md). mu / full: chosen on a training task of
# the suite (never a held-out one).
# step_tokens: a training batch takes batch_size examples, fewer where their padded batch would pass
# this many tokens (at least one; 0: no cap). A step's time grows with its tokens, so long examples
# (real tasks' questions) train one or two a step and a registration keeps its time budget, while
# the procedural suite's short ones batch as before. Why this value, and what it costs in answers:
# docs/RESULTS.md, "Registration time on BIG-bench-length inputs".
DEFAULTS: dict[str, dict[str, float]] = {
    "routing": {"steps": 15, "lr": 0.3, "batch_size": 4, "step_tokens": 256},
    "mu": {"steps": 40, "lr": 3e-3, "batch_size": 8},
    "full": {"steps": 40, "lr": 1e-3, "batch_size": 8},  # lr of the skills' copy; its routing row uses FULL_ROW_LR
    "plain-lora": {"steps": 40, "lr": 3e-3, "batch_size": 8},  # mu's budget: a baseline, not a registration path
}


@dataclass(frozen=True)
class AdaptConfig:
    """How one adaptation trains (training/adapt.py): see the module docstring there for the methods."""

    method: str = "routing"
    steps: int | None = None  # None: DEFAULTS[method], more for a routing run on many examples (budget())
    lr: float | None = None  # None: DEFAULTS[method]
    batch_size: int | None = None  # None: DEFAULTS[method]; at most the training examples
    step_tokens: int | None = None  # None: DEFAULTS[method] (0 where it names none: no cap)
    seed: int = 0
    holdout_fraction: float | None = None  # None: HOLDOUT, or 0 for a long run (budget())
    eval_every: int = 5  # values below 1 act as 1
    patience: int = 3  # held-out evaluations without a new best before stopping
    # what the best is, of the held-out evaluations: "loss" (the mean held-out loss) or "exact" (the
    # held-out exact match, training.loss.per_example_exact; the loss between equals)
    select: str = "loss"
    max_length: int = FEW_SHOT_MAX_LENGTH
    autocast: bool | str | None = None  # None / "auto": bf16 only where it is fast (training/precision.py)
    trained_share: float = 1.0  # routing only: the top share of the adapted linears that train
    # early stopping both ways: past `steps`, training goes on `eval_every` steps at a time while
    # the latest held-out evaluation is the best so far, up to `max_steps` (None: `steps`, no extension)
    max_steps: int | None = None

    def __post_init__(self) -> None:
        if self.method not in ADAPT_METHODS:
            raise ValueError(f"method must be one of {'|'.join(ADAPT_METHODS)}, got {self.method!r}")
        if self.resolved_steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        if self.resolved_max_steps < self.resolved_steps:
            raise ValueError(f"max_steps must be >= steps ({self.resolved_steps}), got {self.max_steps}")
        if self.resolved_step_tokens < 0:
            raise ValueError(f"step_tokens must be >= 0 (0: no cap), got {self.step_tokens}")
        if self.holdout_fraction is not None and not 0.0 <= self.holdout_fraction < 1.0:
            raise ValueError(f"holdout_fraction must be in [0, 1), got {self.holdout_fraction}")
        if self.select not in SELECT_CHOICES:
            raise ValueError(f"select must be one of {'|'.join(SELECT_CHOICES)}, got {self.select!r}")
        if not 0.0 < self.trained_share <= 1.0:
            raise ValueError(f"trained_share must be in (0, 1], got {self.trained_share}")
        if self.trained_share < 1.0 and self.method != "routing":
            raise ValueError("trained_share < 1 applies to the routing method only")
        if not (self.autocast is None or isinstance(self.autocast, bool) or self.autocast in AUTOCAST_CHOICES):
            raise ValueError(f"autocast must be one of {'|'.join(AUTOCAST_CHOICES)}, got {self.autocast!r}")

    def budget(self, n_examples: int) -> tuple[int, int, float]:
        """(steps, max_steps, held-out share) of a run on n_examples: the values set, else the method's
        defaults, where a routing run on LONG_FROM examples or more is a long one (LONG_PASSES)."""
        long = self.method == "routing" and n_examples >= LONG_FROM
        holdout = self.holdout_fraction if self.holdout_fraction is not None else 0.0 if long else HOLDOUT
        steps = self.resolved_steps
        if long and self.steps is None:
            steps = min(LONG_MAX_STEPS, math.ceil(LONG_PASSES * n_examples / self.resolved_batch_size))
        return steps, max(steps, self.resolved_max_steps), holdout

    @property
    def resolved_steps(self) -> int:
        return int(self.steps if self.steps is not None else DEFAULTS[self.method]["steps"])

    @property
    def resolved_max_steps(self) -> int:
        return self.resolved_steps if self.max_steps is None else int(self.max_steps)

    @property
    def resolved_step_tokens(self) -> int:
        return int(self.step_tokens if self.step_tokens is not None else DEFAULTS[self.method].get("step_tokens", 0))

    @property
    def resolved_lr(self) -> float:
        return float(self.lr if self.lr is not None else DEFAULTS[self.method]["lr"])

    @property
    def resolved_batch_size(self) -> int:
        return int(self.batch_size if self.batch_size is not None else DEFAULTS[self.method]["batch_size"])
