"""Routing weights of tasks over skills: pure functions over tensors.

A task's routing for one adapted linear is a logits matrix of shape (h, S): h routing heads
(h = 1 is Poly, h > 1 is MHR), S skills. Every function below maps logits (..., h, S) to
mixing weights (..., h, S) — any leading dims (layers, rows of a batch) pass through.

    eval     p = sigmoid(logits);            w = p / (sum_s p + EPS)      (each head sums to 1)
    gumbel   p = RelaxedBernoulli(τ, logits) (reparameterised sample);  same normalisation
    uniform  w = 1 / S                                                     (μ: the skills' average)
    hyper    w = logits                                                    (real-valued embedding)
"""

from __future__ import annotations

from typing import Literal

import torch

EPS = 1e-12

RoutingKind = Literal["sigmoid", "gumbel", "uniform", "hyper"]


def normalize(p: torch.Tensor) -> torch.Tensor:
    """p: (..., h, S) non-negative -> (..., h, S), each head's weights summing to 1."""
    return p / (p.sum(dim=-1, keepdim=True) + EPS)


def eval_weights(logits: torch.Tensor) -> torch.Tensor:
    """Deterministic weights used at inference: normalised sigmoid. logits: (..., h, S)."""
    return normalize(torch.sigmoid(logits))


def gumbel_sigmoid(
    logits: torch.Tensor, temperature: float = 1.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """A reparameterised RelaxedBernoulli(temperature, logits) sample, shape of logits.

    y = sigmoid((logits + log u - log(1 - u)) / τ),  u ~ U(0, 1): the binary-Concrete
    distribution of torch.distributions.RelaxedBernoulli, with an explicit generator so
    training is reproducible.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    # drawn where the generator lives (a CPU generator drives GPU training too), then moved
    where = generator.device if generator is not None else logits.device
    u = torch.rand(logits.shape, generator=generator, device=where, dtype=logits.dtype).to(logits.device)
    u = u.clamp(torch.finfo(logits.dtype).tiny, 1.0 - torch.finfo(logits.dtype).eps)
    noise = torch.log(u) - torch.log1p(-u)
    return torch.sigmoid((logits + noise) / temperature)


def train_weights(
    logits: torch.Tensor, temperature: float = 1.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Training-time weights: Gumbel-sigmoid sample, then per-head normalisation."""
    return normalize(gumbel_sigmoid(logits, temperature, generator))


def uniform_weights(h: int, n_skills: int, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """μ routing: (h, S) filled with 1/S — the average of all skills."""
    return torch.full((h, n_skills), 1.0 / n_skills, dtype=dtype)


def refine_row(logits: torch.Tensor, factor: int) -> torch.Tensor:
    """A routing row (..., h, S) for skills refined to h * factor heads (`combine.refine_heads`):
    each head's logits repeated for its `factor` finer heads, so the weights, and the adapter, are
    unchanged (for every routing kind: each maps a head's logits to its weights on its own)."""
    if factor < 1:
        raise ValueError(f"factor must be >= 1, got {factor}")
    return logits.repeat_interleave(factor, dim=-2)


def routing_weights(
    logits: torch.Tensor,
    kind: RoutingKind = "sigmoid",
    *,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Dispatch on the routing kind; logits (..., h, S) -> weights (..., h, S)."""
    if kind == "sigmoid":
        return eval_weights(logits)
    if kind == "gumbel":
        return train_weights(logits, temperature, generator)
    if kind == "uniform":
        return torch.full_like(logits, 1.0 / logits.shape[-1])
    if kind == "hyper":
        return logits
    raise ValueError(f"routing kind must be one of sigmoid|gumbel|uniform|hyper, got {kind!r}")
