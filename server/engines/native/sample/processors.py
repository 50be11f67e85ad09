"""Logits processors: logit_bias, the repetition / frequency / presence penalties and vLLM's
min_tokens mask. Pure.

Applied in float32 to the rows that ask for them, in vLLM's order (before temperature, so a
greedy row takes the argmax of the processed logits):

    for n in rows with processors:
        l = logits[n]
        l[t] += bias[n][t]                                    logit_bias          (OpenAI)
        seen = prompt tokens ∪ generated tokens of row n
        l[t] = l[t] / r if l[t] > 0 else l[t] * r, t in seen  repetition_penalty  (HF / vLLM)
        l[t] -= f * count[n][t]                               frequency_penalty   (OpenAI)
        l[t] -= p * (count[n][t] > 0)                         presence_penalty    (OpenAI)
        l[t] = -inf, t in stop ids, while generated[n] < m    min_tokens          (vLLM)
    count[n][t] = times row n has generated t (its own choice only; the prompt does not count)

Sparse: a penalty only touches the tokens a row has seen, so each row keeps the list of its seen
tokens (prompt tokens only when repetition_penalty != 1) with their generated counts, and a step
gathers / scatters those K entries of all rows at once: O(K) work instead of several passes over
(rows x vocab) (49k-token vocab: ~1 ms per row and pass on one CPU core). Duplicate logit_bias
entries for one token add up.

Logprobs are never taken from the processed logits (see sampling.py). The state a row carries
(`RowProcessors`) is per choice: the n choices of one request share the prompt part and each
counts its own tokens.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                     bias: torch.Tensor) -> torch.Tensor:
    """logits (P, V) float; rows, tokens, bias (K,): logits[rows[k], tokens[k]] += bias[k] (in place)."""
    return logits.index_put_((rows, tokens), bias, accumulate=True)


def apply_penalties(
    logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor,
    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor,
) -> torch.Tensor:
    """logits (P, V) float, changed in place at K entries; rows, tokens (K,): the seen tokens of
    each row, each (row, token) once; counts (K,): how often the row generated the token (0 for
    a prompt-only token); presence, frequency, repetition (K,): the row's penalty per entry."""
    values = logits[rows, tokens]
    values = torch.where(values > 0, values / repetition, values * repetition)
    values = values - frequency * counts - presence * (counts > 0).to(values.dtype)
    logits[rows, tokens] = values
    return logits


@dataclass
class SeenTokens:
    """One row's seen tokens (K,) with their generated counts, in growable buffers."""

    tokens: torch.Tensor  # (capacity,) long, first `size` valid
    counts: torch.Tensor  # (capacity,) float32
    size: int = 0
    where: dict[int, int] = field(default_factory=dict)  # token -> position

    @classmethod
    def of(cls, prompt_tokens: list[int], device: torch.device | str) -> SeenTokens:
        unique = list(dict.fromkeys(prompt_tokens))
        capacity = len(unique) + 64
        tokens = torch.zeros(capacity, dtype=torch.long, device=device)
        tokens[: len(unique)] = torch.tensor(unique, dtype=torch.long)
        counts = torch.zeros(capacity, dtype=torch.float32, device=device)
        return cls(tokens, counts, len(unique), {t: i for i, t in enumerate(unique)})

    def add(self, token: int) -> None:
        pos = self.where.get(token)
        if pos is not None:
            self.counts[pos] += 1
            return
        if self.size == self.tokens.shape[0]:
            grow = self.size + 64
            self.tokens = torch.cat([self.tokens, self.tokens.new_zeros(grow)])
            self.counts = torch.cat([self.counts, self.counts.new_zeros(grow)])
        self.tokens[self.size] = token
        self.counts[self.size] = 1
        self.where[token] = self.size
        self.size += 1


@dataclass
class RowProcessors:
    """One choice's processors and their state; `seen` is None without penalties (bias only)."""

    bias_tokens: torch.Tensor  # (B,) long
    bias_values: torch.Tensor  # (B,) float32
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    seen: SeenTokens | None = None
    banned: torch.Tensor | None = None  # (K,) long: the stop ids masked while generated < min_tokens
    min_tokens: int = 0
    generated: int = 0

    @classmethod
    def build(cls, params, prompt_ids: list[int], vocab_size: int, device: torch.device | str = "cpu",
              eos_ids: frozenset[int] = frozenset()) -> RowProcessors | None:
        """From SamplingParams; None when the row has no processor (the common, fast path).
        eos_ids: the model's end tokens (masked by min_tokens unless ignore_eos, as vLLM does)."""
        penalties = params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1
        bias = [(t, b) for t, b in params.logit_bias if b != 0]
        stop_ids = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids)))
        banned = [t for t in stop_ids if 0 <= t < vocab_size] if params.min_tokens > 0 else []
        if not penalties and not bias and not banned:
            return None
        for token, _ in bias:
            if not 0 <= token < vocab_size:
                raise ValueError(f"logit_bias: token id {token} is outside the vocabulary (size {vocab_size})")
        seen = None
        if penalties:
            prompt = [t for t in prompt_ids if 0 <= t < vocab_size] if params.repetition_penalty != 1 else []
            seen = SeenTokens.of(prompt, device)
        return cls(
            bias_tokens=torch.tensor([t for t, _ in bias], dtype=torch.long, device=device),
            bias_values=torch.tensor([b for _, b in bias], dtype=torch.float32, device=device),
            presence=params.presence_penalty, frequency=params.frequency_penalty,
            repetition=params.repetition_penalty, seen=seen,
            banned=torch.tensor(banned, dtype=torch.long, device=device) if banned else None,
            min_tokens=params.min_tokens if banned else 0,
        )

    def fork(self) -> RowProcessors:
        """The state of another choice of the same request: same prompt, no tokens generated yet
        (call before the first `observe`)."""
        other = copy.copy(self)
        other.generated = 0
        if self.seen is not None:
            other.seen = SeenTokens(self.seen.tokens.clone(), self.seen.counts.clone(), self.seen.size,
                                    dict(self.seen.where))
        return other

    @property
    def masking(self) -> bool:
        """The min_tokens mask applies to the next token."""
        return self.banned is not None and self.generated < self.min_tokens

    def observe(self, token: int) -> None:
        """The row generated `token`."""
        self.generated += 1
        if self.seen is not None:
            self.seen.add(token)


def apply_processors(logits: torch.Tensor, procs: list[RowProcessors], *, inplace: bool = False) -> torch.Tensor:
    """logits (P, V), one RowProcessors per row -> processed float32 logits (P, V): a new tensor,
    or `logits` itself when inplace and already float32. Vectorised over rows: one index_put for
    every row's bias, one gather/scatter of every row's seen tokens for the penalties."""
    out = logits.float()
    if out is logits and not inplace:
        out = out.clone()
    device = out.device
    biased = [(i, p) for i, p in enumerate(procs) if p.bias_tokens.numel()]
    if biased:
        rows = torch.cat([torch.full_like(p.bias_tokens, i) for i, p in biased])
        apply_logit_bias(out, rows, torch.cat([p.bias_tokens for _, p in biased]),
                         torch.cat([p.bias_values for _, p in biased]))
    pen = [(i, p) for i, p in enumerate(procs) if p.seen is not None and p.seen.size]
    if pen:
        sizes = torch.tensor([p.seen.size for _, p in pen], device=device)  # type: ignore[union-attr]

        def per_entry(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device).repeat_interleave(sizes)

        apply_penalties(
            out, per_entry([i for i, _ in pen], torch.long),
            torch.cat([p.seen.tokens[: p.seen.size] for _, p in pen]),  # type: ignore[union-attr]
            torch.cat([p.seen.counts[: p.seen.size] for _, p in pen]),  # type: ignore[union-attr]
            per_entry([p.presence for _, p in pen]), per_entry([p.frequency for _, p in pen]),
            per_entry([p.repetition for _, p in pen]),
        )
    masked = [(i, p.banned) for i, p in enumerate(procs) if p.masking]
    if masked:
        rows = torch.cat([torch.full_like(b, i) for i, b in masked])  # type: ignore[arg-type]
        out[rows, torch.cat([b for _, b in masked])] = float("-inf")  # type: ignore[misc]
    return out
