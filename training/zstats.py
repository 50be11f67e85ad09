"""Statistics of a task-skill allocation matrix Z (Polytropon, Ponti et al. 2022, eq. 5-7). Pure.

Z: (..., T, S) with cells in [0, 1] (sigmoid of the routing logits: task t's probability of
using skill s); leading dims (layers, heads) are averaged over.

    discreteness = 1 - mean_{t,s} H_b(Z[t, s]) / log 2     1: every cell 0 or 1 (binary), 0: all 0.5
    sparsity     = mean_{t,s} round(Z[t, s])                 fraction of (task, skill) pairs in use
    usage        = H(c / sum c) / log S,  c_s = sum_t Z[t, s]  1: every skill used equally, 0: one skill

(The paper calls the first "normalised entropy" with 1 = binary: we report one minus the
normalised binary entropy so that the number means what the paper says it means.)
"""

from __future__ import annotations

import math

import torch

EPS = 1e-12


def binary_entropy(z: torch.Tensor) -> torch.Tensor:
    """H_b(z) in nats, elementwise, with 0 log 0 = 0."""
    z = z.double()
    return -(torch.xlogy(z, z) + torch.xlogy(1 - z, 1 - z))


def discreteness(Z: torch.Tensor) -> float:
    return float(1.0 - (binary_entropy(Z) / math.log(2)).mean())


def sparsity(Z: torch.Tensor) -> float:
    return float(torch.round(Z.double()).mean())


def usage(Z: torch.Tensor) -> float:
    """Normalised entropy of the skills' column sums, averaged over leading dims. S = 1 gives 1."""
    n_skills = Z.shape[-1]
    if n_skills == 1:
        return 1.0
    c = Z.double().sum(dim=-2)  # (..., S)
    q = c / (c.sum(dim=-1, keepdim=True) + EPS)
    h = -torch.xlogy(q, q).sum(-1) / math.log(n_skills)
    return float(h.mean())


def allocation(logits: torch.Tensor) -> torch.Tensor:
    """Routing rows (T, L, h, S) -> Z (L, h, T, S) = sigmoid(logits), tasks next to skills."""
    return torch.sigmoid(logits.double()).permute(1, 2, 0, 3)


def z_stats(logits: torch.Tensor) -> dict[str, float]:
    """All three statistics of the training tasks' routing rows (T, L, h, S)."""
    Z = allocation(logits)
    return {"discreteness": discreteness(Z), "sparsity": sparsity(Z), "usage": usage(Z)}
