"""Zero-shot routing from the skills' own weights (Arrow's idea, Ostapenko et al. 2024): no examples,
no training, a routing decision per token, per adapted linear and per routing head.

Skill s of a layer is the LoRA A_s = concat_k A[k, s] (d_in, r) over the heads' input rows and
B_s = concat_k B[k, s] (r, d_out) over their output columns (what a routing row that puts every head on
s materialises), so ΔW_s = A_s @ B_s and x @ ΔW_s = sum_k x_k @ A[k, s] @ B_s: head k's input block
x_k = x[k*d_in/h:(k+1)*d_in/h] reaches every output column (an MHR LoRA is not block-diagonal). Arrow
routes each input block on its own:

    prototype  v[k, s] = the input-side top singular vector of ΔW_s's rows of head k,
                         ΔW_s[k] = A[k, s] @ B_s   (d_in/h, d_out)
                         (the top *right* singular vector of nn.Linear's (d_out, d_in) view, ΔWᵀ)
    for every token x:
        logit[k, s] = |<x_k, v[k, s]>|                  sign-free: v is defined up to sign
        w[k] = softmax(logit[k] / temperature) over head k's top_k skills, 0 for the others
        delta = sum_k sum_s w[k, s] * (x_k @ A[k, s]) @ B_s * scale

With h = 1 this is Arrow as published. It is a mixture of per-skill outputs, not a mix of the skills'
A and B (what a routing row gives): the two agree when every head of a token picks one skill, or
when the skills are identical (then both equal μ).

The prototype needs no (d_in/h, d_out) SVD: with A[k, s] = Q R (reduced QR, Q orthonormal),
ΔW_s[k] = Q (R B_s), and if R B_s = U Σ Vᵀ then ΔW_s[k] = (Q U) Σ Vᵀ, so v[k, s] = Q @ U[:, 0]:
an r x d_out SVD.

Use on a RoutedModel: `plan = arrow_plan(rm)` snapshots the prototypes and stacked skills; the plan is an
OwnPlan, so `rm.batch.set(plan)` routes a plain forward. The evaluation helpers (training.evaluate) set
their own plan on `rm.batch` for every batch, so for them `with arrow_routing(rm, plan): ...` pins the
plan on every layer for the duration and puts each layer's own batch back afterwards, also after an
exception.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from adapters_store.lora.batched import stack_skills
from adapters_store.lora.inject import RoutedModel
from adapters_store.lora.layer import AdapterBatch
from training.batching import FEW_SHOT_MAX_LENGTH
from training.evaluate import score_rows

DEFAULT_TOP_K = 4  # a few skills per token, as Arrow routes; an inventory of fewer skills needs top_k=None
DEFAULT_TEMPERATURE = 1.0


@dataclass(frozen=True)
class ArrowConfig:
    """top_k: skills kept per token and head (None = all of them); temperature of the softmax over them."""

    top_k: int | None = DEFAULT_TOP_K
    temperature: float = DEFAULT_TEMPERATURE

    def __post_init__(self) -> None:
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be a positive int or None, got {self.top_k!r}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")

    def k_for(self, n_skills: int) -> int:
        if self.top_k is None:
            return n_skills
        if self.top_k > n_skills:
            raise ValueError(f"top_k={self.top_k} exceeds the inventory's {n_skills} skills")
        return self.top_k


def skill_outputs(B: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """B: (h, S, r, d_out/h) -> each skill's whole B_s stacked, (S*r, d_out) * scale: rows s*r..(s+1)*r are
    B_s, whose columns d_out/h*k.. are head k's B[k, s] (the layout adapters_store.lora.combine materialises)."""
    h, n_skills, r, d_out_h = B.shape
    return (B.permute(1, 2, 0, 3).reshape(n_skills * r, h * d_out_h) * scale).contiguous()


def skill_prototypes(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """A: (h, S, d_in/h, r); B: (h, S, r, d_out/h) -> prototypes (h, S, d_in/h), unit norm, float32.

    prototypes[k, s] = input-side top singular vector of A[k, s] @ B_s (up to sign)."""
    _, n_skills, _, r = A.shape
    B_s = skill_outputs(B.float()).view(n_skills, r, -1)  # (S, r, d_out)
    Q, R = torch.linalg.qr(A.float())  # Q (h, S, d_in/h, r'), R (h, S, r', r)
    U, _, _ = torch.linalg.svd(R @ B_s, full_matrices=False)  # (h, S, r', r')
    return (Q @ U[..., :1]).squeeze(-1)


def arrow_weights(x: torch.Tensor, prototypes: torch.Tensor, top_k: int, temperature: float) -> torch.Tensor:
    """x: (M, d_in) tokens; prototypes: (h, S, d_in/h) -> routing weights (h, M, S), float32.

    Each token's weights per head are a softmax of |<x_k, v[k, s]>| / temperature over its top_k skills
    (exactly 0 for the others); they sum to 1."""
    h, n_skills, d_in_h = prototypes.shape
    xh = x.float().reshape(-1, h, d_in_h).transpose(0, 1)  # (h, M, d_in/h)
    logits = torch.bmm(xh, prototypes.float().transpose(1, 2)).abs()  # (h, M, S)
    if top_k < n_skills:
        kept = logits.topk(top_k, dim=-1).indices
        logits = logits + torch.full_like(logits, float("-inf")).scatter_(-1, kept, 0.0)
    return torch.softmax(logits / temperature, dim=-1)


def mixture_delta(x: torch.Tensor, A_cat: torch.Tensor, B_all: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: (M, d_in); A_cat (h, d_in/h, S*r) from batched.stack_skills; B_all (S*r, d_out) from
    skill_outputs (scale folded in); w: (h, M, S) per-token weights -> (M, d_out):

        delta[m] = sum_k sum_s w[k, m, s] * (x[m, block k] @ A[k, s]) @ B_s * scale
    """
    h, d_in_h, sr = A_cat.shape
    M, n_skills = x.shape[0], w.shape[-1]
    u = torch.bmm(x.reshape(M, h, d_in_h).transpose(0, 1), A_cat.to(x.dtype))  # (h, M, S*r): x_k A[k, s]
    z = (u.view(h, M, n_skills, sr // n_skills) * w.to(x.dtype).unsqueeze(-1)).sum(0)  # (M, S, r)
    return z.reshape(M, sr) @ B_all.to(x.dtype)  # sum over skills of z_s @ B_s


def arrow_delta(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float, prototypes: torch.Tensor,
                top_k: int, temperature: float) -> torch.Tensor:
    """x: (..., d_in); A (h, S, d_in/h, r); B (h, S, r, d_out/h); prototypes from skill_prototypes
    -> the Arrow-routed LoRA output (..., d_out). Reference form of ArrowPlan.delta."""
    A_cat, _ = stack_skills(A, B)
    flat = x.reshape(-1, x.shape[-1])
    out = mixture_delta(flat, A_cat, skill_outputs(B, scale), arrow_weights(flat, prototypes, top_k, temperature))
    return out.reshape(*x.shape[:-1], -1)


class ArrowPlan:
    """An OwnPlan (adapters_store.lora.layer) that routes every token of every adapted linear by Arrow.

    A snapshot of the skills when built: rebuild it after the skills change."""

    def __init__(self, rm: RoutedModel, config: ArrowConfig | None = None) -> None:
        self.config = config or ArrowConfig()
        self.top_k = self.config.k_for(rm.spec.n_skills)
        self.prototypes: list[torch.Tensor] = []
        self.stacked: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for layer in rm.layers:
                A, B = layer.lora_A.detach(), layer.lora_B.detach()
                self.prototypes.append(skill_prototypes(A, B).to(A.device))
                self.stacked.append((stack_skills(A, B)[0], skill_outputs(B, layer.scale)))

    def weights(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Routing weights (h, M, S) of the M tokens of x (..., d_in) at adapted linear `layer`."""
        return arrow_weights(x.reshape(-1, x.shape[-1]), self.prototypes[layer], self.top_k, self.config.temperature)

    def delta(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        A_cat, B_all = self.stacked[layer]
        out = mixture_delta(flat, A_cat, B_all, self.weights(layer, flat))
        return out.reshape(*x.shape[:-1], -1)


def arrow_plan(rm: RoutedModel, top_k: int | None = DEFAULT_TOP_K,
               temperature: float = DEFAULT_TEMPERATURE) -> ArrowPlan:
    return ArrowPlan(rm, ArrowConfig(top_k, temperature))


@contextmanager
def arrow_routing(rm: RoutedModel, plan: ArrowPlan) -> Iterator[ArrowPlan]:
    """Every adapted linear of rm reads `plan` for the duration, whatever is set on rm.batch meanwhile
    (evaluate_task / score_rows set their own plan per batch: pass them adapter=None; an adapter passed
    inside is not applied). Each layer's own batch is back afterwards, also after an exception; rm.batch
    itself is not touched here."""
    pinned = AdapterBatch()
    pinned.set(plan)
    own = [layer.batch for layer in rm.layers]
    try:
        for layer in rm.layers:
            layer.batch = pinned
        yield plan
    finally:
        for layer, batch in zip(rm.layers, own, strict=True):
            layer.batch = batch


def arrow_score_rows(rm: RoutedModel, tokenizer: Any, rows: Sequence[dict[str, Any]],
                     top_k: int | None = DEFAULT_TOP_K, temperature: float = DEFAULT_TEMPERATURE,
                     max_length: int = FEW_SHOT_MAX_LENGTH, batch_size: int = 16) -> dict[str, float]:
    """training.evaluate.score_rows (exact match, ll_acc, loss) with Arrow routing instead of a task's adapter."""
    with arrow_routing(rm, arrow_plan(rm, top_k, temperature)):
        return score_rows(rm, None, tokenizer, rows, max_length=max_length, batch_size=batch_size)
