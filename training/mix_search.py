"""Gradient-free mixing of stored routing rows (LoraHub's idea, in routing space): a baseline.

LoraHub composes a new task's LoRA as a weighted sum of stored LoRAs and searches the weights with
forward passes only (a black-box optimiser, about 40 evaluations of the few-shot loss plus an L1
penalty). Here a stored task is its routing row, so the composed task is one routing row,

    logits = sum_i w_i * row_i        over n_rows stored rows drawn at random (seeded)

and the search is a (1, lambda) evolution strategy from w = 0 (μ, the skills' average): each
generation samples lambda weight vectors around the best so far, keeps the best by
`loss(examples) + l1 * |w|_1`, and narrows its step. No gradient, no backward pass: what a
server could run without autograd. The result is a "routing" AdaptResult, served like any row.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from typing import Any

import torch

from adapters_store.lora.inject import RoutedModel
from adapters_store.store.records import InventoryInfo
from training.adapt import AdaptResult
from training.batching import FEW_SHOT_MAX_LENGTH, collate, encode_all
from training.data import Example
from training.loss import target_logits, token_loss
from training.precision import resolve_autocast
from training.routing_table import row_weights


def mixed_row(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(n, L, h, S) stored logits, (n,) weights -> (L, h, S)."""
    return torch.einsum("n,nlhs->lhs", w, rows)


@torch.no_grad()
def gradient_free_mix(rm: RoutedModel, info: InventoryInfo, candidates: Mapping[str, torch.Tensor],
                      examples: list[Example], tokenizer: Any, *, seed: int = 0, n_rows: int = 20,
                      budget: int = 40, population: int = 8, sigma: float = 0.5, shrink: float = 0.7,
                      l1: float = 0.05, max_length: int = FEW_SHOT_MAX_LENGTH,
                      autocast: bool | str | None = None) -> AdaptResult:
    """Search mixing weights of `n_rows` random stored rows with `budget` loss evaluations."""
    if info.spec.routing == "hyper":
        raise ValueError("gradient-free mixing mixes routing logits; a hypernetwork inventory has none")
    if not examples:
        raise ValueError("gradient-free mixing needs at least one example")
    started = time.perf_counter()
    rng = random.Random(seed)
    names = sorted(candidates)
    names = rng.sample(names, min(n_rows, len(names)))
    L, h, S = len(info.layer_names), info.spec.n_heads, info.spec.n_skills
    routing = "sigmoid"  # every routing but hyper (refused above) reads logits through a sigmoid
    rows = (torch.stack([candidates[n].float().cpu() for n in names]) if names else torch.zeros(0, L, h, S))
    device = rm.layers[0].lora_A.device
    use_autocast = resolve_autocast(autocast, device)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    batch = collate(encode_all(tokenizer, examples, max_length), pad)
    previous = rm.batch.plan
    gen = torch.Generator().manual_seed(seed)

    def objective(w: torch.Tensor) -> float:
        weights = row_weights(mixed_row(rows, w), routing, train=False).to(device)
        rm.set_materialized(weights, rows=batch.input_ids.shape[0])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
            loss = float(token_loss(target_logits(rm.model, batch)))
        return loss + l1 * float(w.abs().sum())

    try:
        best_w = torch.zeros(len(names))
        best = objective(best_w)
        mu_loss, evals, step = best, 1, sigma
        while evals < budget and len(names):
            for _ in range(min(population, budget - evals)):
                w = best_w + step * torch.randn(len(names), generator=gen)
                value = objective(w)
                evals += 1
                if value < best:
                    best, best_w = value, w
            step *= shrink
    finally:
        rm.batch.set(previous)
    metrics = {"method": "mix", "candidates": names, "weights": [round(float(x), 4) for x in best_w],
               "objective": best, "mu_objective": mu_loss, "evaluations": evals,
               "seconds": round(time.perf_counter() - started, 3)}
    return AdaptResult("routing", {"logits": mixed_row(rows, best_w) if len(names) else torch.zeros(L, h, S)},
                       metrics, params=0)
