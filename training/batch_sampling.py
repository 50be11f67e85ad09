"""Which examples make up the next multi-task batch. Pure functions over sizes and scores.

    uniform        task ~ U(tasks), then an example of it
    proportional   task ~ size_t / sum(sizes) (= an example drawn uniformly from the union)
    uncertainty    CA-MTL's MT-Uncertainty Sampling (Pilault et al. 2021, Algorithm 1):
                     for every task t: draw `pool` candidate examples
                     score each candidate with the model's normalised predictive entropy
                       H(p) / log V averaged over its target tokens (no gradient)
                     keep the `batch_size` candidates with the highest score
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

SAMPLINGS = ("uniform", "proportional", "uncertainty")


def task_probabilities(sizes: Sequence[int], mode: str) -> list[float]:
    """Probability of drawing each task for one batch row."""
    if not sizes or min(sizes) < 1:
        raise ValueError("every task needs at least one example")
    if mode in ("uniform", "uncertainty"):
        return [1.0 / len(sizes)] * len(sizes)
    if mode == "proportional":
        total = float(sum(sizes))
        return [s / total for s in sizes]
    raise ValueError(f"sampling must be one of {'|'.join(SAMPLINGS)}, got {mode!r}")


def draw_rows(sizes: Sequence[int], n: int, mode: str, rng: random.Random) -> list[tuple[int, int]]:
    """n (task, example) pairs for the uniform / proportional modes."""
    probs = task_probabilities(sizes, mode)
    tasks = rng.choices(range(len(sizes)), weights=probs, k=n)
    return [(t, rng.randrange(sizes[t])) for t in tasks]


def draw_candidates(sizes: Sequence[int], pool: int, rng: random.Random) -> list[tuple[int, int]]:
    """`pool` candidate (task, example) pairs from every task (uncertainty sampling's first step)."""
    return [(t, rng.randrange(size)) for t, size in enumerate(sizes) for _ in range(pool)]


def most_uncertain(scores: torch.Tensor, k: int) -> list[int]:
    """Indices of the k highest scores (ties broken by position), in ascending index order."""
    k = min(k, scores.numel())
    top = torch.topk(scores, k, sorted=False).indices
    return sorted(int(i) for i in top)
