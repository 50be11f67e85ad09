"""Task search: which tasks route most like a given one. Pure functions over routing weights.

A task's routing row, as inference weights w (L, h, S) (each head a distribution over the S
skills), describes the task in skill space. Two tasks are compared by the cosine of their rows'
deviations from μ (every head uniform, w = 1/S):

    v(t)        = flatten(w_t - 1/S)                            (D = L*h*S numbers)
    score(a, b) = <v(a), v(b)> / (|v(a)| |v(b)|)                in [-1, 1]

Centring on μ matters: every row is a point of the same simplex, so raw rows share a large common
component (their mean) and the raw cosine of any two tasks is close to 1; the deviations from μ
say which skills a task uses more or less than the average, and tasks routed alike score near 1.
A row equal to μ has no direction: it scores 0 against everything.

At scale (many tasks of a large inventory: D = 7,680 numbers for the shipped one) the index keeps
each row projected to `dim` dimensions by a fixed Gaussian matrix (Johnson-Lindenstrauss: inner
products kept within about 1/sqrt(dim)), shortlists the `shortlist` best candidates in that space,
and ranks them by their exact score (server/registry/similar_index.py). rank_exact is the reference.
"""

from __future__ import annotations

import torch

EPS = 1e-12


def centred(weights: torch.Tensor) -> torch.Tensor:
    """weights (..., L, h, S) -> (..., L*h*S): deviation from μ, flattened."""
    n_skills = weights.shape[-1]
    return (weights.float() - 1.0 / n_skills).flatten(-3)


def unit(v: torch.Tensor) -> torch.Tensor:
    """Rows (..., D) scaled to norm 1 (a zero row stays zero)."""
    return v / (v.norm(dim=-1, keepdim=True) + EPS)


def projection(d: int, dim: int, seed: int = 0) -> torch.Tensor:
    """A fixed (d, dim) Gaussian projection scaled by 1/sqrt(dim) (the same for a given seed)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(d, dim, generator=gen) / dim**0.5


def top_k(scores: torch.Tensor, k: int, exclude: int | None = None) -> list[tuple[int, float]]:
    """(index, score) of the k highest scores, best first (ties: lower index first); `exclude`
    (the query itself) is left out."""
    if exclude is not None:
        scores = scores.clone()
        scores[exclude] = -float("inf")
    k = min(k, scores.numel() - (exclude is not None))
    if k <= 0:
        return []
    values, index = torch.sort(scores, descending=True, stable=True)
    return [(int(i), float(v)) for v, i in zip(values[:k], index[:k], strict=True)]


def rank_exact(query: torch.Tensor, rows: torch.Tensor, k: int, exclude: int | None = None) -> list[tuple[int, float]]:
    """query (L, h, S) weights, rows (N, L, h, S) -> the k nearest rows: (index, score)."""
    scores = unit(centred(rows)) @ unit(centred(query))
    return top_k(scores, k, exclude)
