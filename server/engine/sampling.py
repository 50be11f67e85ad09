"""Next-token choice per row: greedy, temperature, top-k, top-p, with per-row generators. Pure.

    for n in rows:
        if greedy[n]:  tok[n] = argmax(logits[n])
        else:          p = softmax(top_p(top_k(logits[n] / T[n], k[n]), p[n]));  tok[n] ~ p  (gen[n])
"""

from __future__ import annotations

import torch


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits: (V,) -> (V,) with all but the k largest set to -inf (k = 0 or >= V: unchanged)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of tokens whose probability mass reaches p (>= 1 token)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly better tokens
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_row(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator
) -> int:
    """logits: (V,) float -> one token id drawn with the row's own generator."""
    scaled = logits.float() / temperature
    scaled = apply_top_p(apply_top_k(scaled, top_k), top_p)
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


def choose_tokens(
    logits: torch.Tensor,
    greedy: list[bool],
    temperature: list[float],
    top_k: list[int],
    top_p: list[float],
    generators: list[torch.Generator | None],
) -> list[int]:
    """logits: (N, V) -> N token ids. Greedy rows take one vectorised argmax."""
    out = logits.argmax(dim=-1).tolist()  # greedy answer for every row; sampled rows overwrite
    for n, is_greedy in enumerate(greedy):
        if not is_greedy:
            gen = generators[n]
            assert gen is not None, "sampled rows carry a generator"
            out[n] = sample_row(logits[n], temperature[n], top_k[n], top_p[n], gen)
    return out
