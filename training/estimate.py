"""How far a registration's held-out exact match can be trusted: the count it was measured on, a
Wilson score interval, and a plain note below a floor.

A perfect score on a handful of held-out examples is compatible with a task answered right far
less often; reported bare, it read as a promise. The Wilson interval (at LEVEL) says how far the
figure can be off, and below MIN_HELD held-out examples the job also says "too few held-out
examples" in words: there even a perfect score's interval is wide (README "Operations" gives the
numbers). A registration's held-out share is training/adapt_config.py HOLDOUT.

The examples held out are also the ones early stopping chose the best step on, so the figure is
if anything optimistic: the interval is the least the user should allow for.
"""

from __future__ import annotations

import math
from typing import Any

LEVEL = 0.9
Z = 1.6448536269514722  # the standard normal's 95th percentile: a two-sided 90% interval
MIN_HELD = 10


def wilson(successes: int, n: int, z: float = Z) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (successes of n, n >= 1).

    >>> [round(x, 3) for x in wilson(4, 4)]
    [0.597, 1.0]
    >>> [round(x, 3) for x in wilson(5, 8)]
    [0.348, 0.839]
    """
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n >= 1, got {successes} of {n}")
    p, z2 = successes / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def exact_estimate(exact: float | None, n_held: int) -> dict[str, Any]:
    """The fields a job reports beside `eval_exact` (added beside it, never renamed):
    eval_exact_n, eval_exact_low / eval_exact_high (LEVEL interval), eval_exact_level, and
    eval_note where the figure should not be read alone."""
    if exact is None or n_held < 1:
        return {"eval_exact_n": 0, "eval_note": "no held-out examples: every example was trained on, so nothing "
                "measured how well the task is learned"}
    right = round(exact * n_held)
    low, high = wilson(right, n_held)
    out: dict[str, Any] = {"eval_exact_n": n_held, "eval_exact_low": round(low, 4), "eval_exact_high": round(high, 4),
                           "eval_exact_level": LEVEL}
    if n_held < MIN_HELD:
        out["eval_note"] = (f"too few held-out examples: {right} of {n_held} right, {LEVEL:.0%} interval "
                            f"{low:.2f}-{high:.2f} (an estimate needs {MIN_HELD} held out, about {4 * MIN_HELD} "
                            "examples)")
    return out
