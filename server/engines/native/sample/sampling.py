"""Next-token choice per row, with per-row failure instead of NaN. Pure.

    for n in rows:
        if logits[n] has a NaN:           row n fails ("the model produced NaN logits")
        l = grammar_mask[n](logits[n])    structured output: -inf where the grammar forbids (grammar_mask.py)
        l = processors[n](l)              logit_bias, penalties (processors.py); none: l unchanged
        if greedy[n]:  tok[n] = argmax(l)                     (temperature < 1e-5 counts as greedy)
        else:          tok[n] ~ softmax(top_p(top_k(min_p(scale(l, T[n]), m[n]), k[n]), p[n]))   gen[n]
        if logprobs[n] is not None:  lp[n] = log_softmax(logits[n]) at tok[n] + top-k  (logprobs.py)

Common path: rows that are greedy with no processors and no logprobs take one vectorised argmax
over the batch (plus an O(N) NaN check on the argmax values); only the other rows are touched
one by one.

Safe math: never NaN/inf into the draw. Temperature scales (l - max(l)) / T, which is <= 0
with its max exactly 0, so it cannot overflow whatever T (>= 1e-5) is and every filtered softmax
is a valid distribution. Processed logits that are already +inf (a repetition_penalty near 0
dividing a large logit) mean "infinitely more likely than the rest": the row samples uniformly
among its +inf tokens (softmax's limit). A NaN, or a row with no token left (all -inf), raises
SamplingError for that row only; the engine fails that row with an error and the others go on.
All of it costs one max per sampled row (no extra pass to check the result).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from server.engines.native.sample.grammar_mask import RowGrammar, mask_rows
from server.engines.native.sample.logprobs import token_logprobs
from server.engines.native.sample.processors import RowProcessors, apply_processors
from server.engines.request import GREEDY_TEMPERATURE, TokenLogprob

__all__ = ["GREEDY_TEMPERATURE", "RowSampler", "Sampled", "SamplingError", "sample_tokens", "scale"]


class SamplingError(ValueError):
    """This row's distribution cannot be sampled (NaN logits, nothing left to choose)."""


@dataclass
class RowSampler:
    """What the sampler needs of one row (one choice). generator None = greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None
    processors: RowProcessors | None = None
    logprobs: int | None = None
    min_p: float = 0.0
    grammar: RowGrammar | None = None  # structured output: its mask applies first (grammar_mask.py)

    @property
    def plain_greedy(self) -> bool:
        return self.generator is None and self.processors is None and self.logprobs is None and self.grammar is None


@dataclass
class Sampled:
    tokens: list[int]  # -1 where the row failed
    errors: list[str | None]
    logprobs: list[TokenLogprob | None]


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits: (V,) -> (V,) with all but the k largest set to -inf (k = 0 or >= V: unchanged)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


# How many of the best tokens top-p ranks first, then how many more if the nucleus is wider: a
# partial selection of a few hundred of a 49k vocabulary costs ~1/30 of sorting all of it, and a
# nucleus rarely holds more.
NUCLEUS_CANDIDATES = (256, 4096)


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of best tokens whose probability mass reaches p (at
    least the best token), and every token tied with the last one kept (the set does not depend on
    how a sort orders ties)."""
    if p >= 1.0:
        return logits
    return logits.masked_fill(logits < nucleus(logits, p)[0], float("-inf"))


def nucleus(logits: torch.Tensor, p: float) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """logits: (V,), p < 1 -> (threshold, members): top-p keeps the tokens whose logit is >= threshold;
    members is (their indices in ascending order, their logits) where a partial ranking found all of
    them, None where the set may reach past the ranked tokens or needed the full sort (most of the
    vocabulary: masking it costs less than ordering its indices), where only the threshold says which.

    Only the best NUCLEUS_CANDIDATES tokens are ranked, more when the nucleus reaches past them:
    a token is kept iff the mass of the tokens ranked before it is below p, so once a ranked
    token falls out, every token after it does too and the rest of the vocabulary needs no order.
    The probabilities are the softmax over the whole vocabulary (its log-sum-exp, one pass)."""
    vocab = logits.shape[-1]
    log_total = torch.logsumexp(logits, dim=-1)
    for k in (*(c for c in NUCLEUS_CANDIDATES if c < vocab), vocab):
        best, order = torch.topk(logits, k) if k < vocab else torch.sort(logits, descending=True)
        cumulative = torch.cumsum((best - log_total).exp(), dim=-1)  # non-decreasing, unlike cumsum - probs
        mass_before = torch.cat([cumulative.new_zeros(1), cumulative[:-1]])
        kept = max(1, int((mass_before < p).sum()))  # a prefix: mass_before never decreases
        if kept < k:
            break  # the k-th ranked token is out, so is everything after it
    threshold = best[kept - 1]
    if k == vocab or not bool(best[-1] < threshold):
        return threshold, None  # ties with the last kept token may lie past the ranked k
    tied = int((best >= threshold).sum())  # best is descending: the kept ones and their ties lead it
    index = order[:tied].sort().values
    return threshold, (index, logits[index])


def apply_min_p(scaled: torch.Tensor, min_p: float) -> torch.Tensor:
    """vLLM's min-p on scaled logits (max exactly 0, see `scale`): drop the tokens whose
    probability is below min_p x the top token's, i.e. whose scaled logit is below log(min_p)."""
    if min_p <= 0.0:
        return scaled
    return scaled.masked_fill(scaled < math.log(min_p), float("-inf"))


def scale(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(V,) processed logits -> (l - max(l)) / T: finite and <= 0 with max exactly 0, so the
    softmax of any top-k/top-p filtering of it (which keeps the max) is a valid distribution.
    +inf logits share all the mass (softmax's limit); NaN (max propagates it) or nothing left
    (all -inf) -> SamplingError."""
    best = float(logits.max())
    if math.isnan(best):
        raise SamplingError("the logits hold NaN after processing")
    if best == float("-inf"):
        raise SamplingError("no token has a finite, positive probability")
    if best == float("inf"):
        return torch.zeros_like(logits).masked_fill_(~torch.isposinf(logits), float("-inf"))
    return (logits - best).div_(temperature)


def sample_row(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
               generator: torch.Generator, min_p: float = 0.0) -> int:
    """logits: (V,) float -> one token id drawn with the row's own generator.

    Where the filters' kept tokens are known as a short list (`nucleus`, `top_k_members`), the
    inverse CDF runs over them in index order: the sums, and so the token, of the one over the
    whole vocabulary where every other token weighs 0, without its passes over the vocabulary."""
    if not temperature >= GREEDY_TEMPERATURE:
        raise SamplingError(f"temperature {temperature} is below {GREEDY_TEMPERATURE}: sample greedily")
    scaled = apply_min_p(scale(logits.float(), temperature), min_p)
    if top_p < 1.0:
        scaled = apply_top_k(scaled, top_k)
        threshold, members = nucleus(scaled, top_p)
        if members is None:
            scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    else:
        members = top_k_members(scaled, top_k)
        if members is None:
            scaled = apply_top_k(scaled, top_k)
    if members is not None:
        index, values = members
        return int(index[draw(values.cpu().exp_(), generator)])
    return draw(scaled.cpu().exp_(), generator)


def top_k_members(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """logits: (V,) -> (indices in ascending order, logits) of the tokens `apply_top_k` keeps, where
    the k + 1 best show no tie past the k-th; None there, and where k keeps no short list (0, or
    as many as the nucleus's second ranking)."""
    if not 0 < k < NUCLEUS_CANDIDATES[-1] or k >= logits.shape[-1]:
        return None
    best, order = torch.topk(logits, k + 1)
    if not bool(best[k] < best[k - 1]):
        return None  # the k-th best is tied past the ranked: only the mask says which are kept
    index = order[:k].sort().values
    return index, logits[index]


def draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """weights: (V,) float, >= 0, not normalised, the largest exactly 1 -> index i with
    probability weights[i] / sum(weights), by inverse CDF: one uniform from the row's generator
    and one cumulative sum. torch.multinomial draws one exponential per vocabulary entry, which
    made it a sampled row's largest cost in a decode step (BENCHMARKS.md, "The long-prompt flood").

    A zero weight is never drawn: its cumulative sum equals its predecessor's, and the search
    returns the first index whose sum is strictly above the target, which is below the total.
    """
    cdf = torch.cumsum(weights, dim=0)
    target = float(torch.rand((), generator=generator, dtype=torch.float64)) * float(cdf[-1])
    i = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True)[0])
    if i >= len(cdf):  # target rounded up to the total: the last token with any weight
        i = int(weights.nonzero()[-1, 0])
    return i


def sample_tokens(logits: torch.Tensor, rows: list[RowSampler]) -> Sampled:
    """logits (N, V) raw -> one token per row (or its error), and logprobs where asked."""
    n = len(rows)
    raw = logits
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if constrained:  # the grammars' masks, on a copy: logprobs stay those of the raw logits
        logits = logits.clone()
        mask_rows(logits, constrained, [rows[i].grammar for i in constrained])  # type: ignore[misc]
    # max propagates NaN (a NaN is "the max"), so a row holds a NaN iff its max is NaN: an O(N)
    # check on values we get anyway, not another pass over (N, V) (~1 ms at 16 x 49k, one core)
    best, argmax = logits.max(dim=-1)
    nan_rows = torch.isnan(best)
    special = [i for i, r in enumerate(rows) if not r.plain_greedy]
    if not special and not bool(nan_rows.any()):  # the common path
        return Sampled(argmax.tolist(), [None] * n, [None] * n)
    tokens: list[int] = argmax.tolist()
    errors: list[str | None] = [None] * n
    for i in nan_rows.nonzero()[:, 0].tolist():
        tokens[i], errors[i] = -1, "the model produced NaN logits"
    special = [i for i in special if errors[i] is None]
    with_procs = [i for i in special if rows[i].processors is not None]
    processed: dict[int, torch.Tensor] = {}
    if with_procs:
        index = torch.tensor(with_procs, device=logits.device)
        out = apply_processors(logits.index_select(0, index), [rows[i].processors for i in with_procs],  # type: ignore[misc]
                               inplace=True)
        best = out.argmax(dim=-1)
        bad = torch.isnan(out.gather(1, best[:, None])[:, 0]).tolist()
        for j, (i, token) in enumerate(zip(with_procs, best.tolist(), strict=True)):
            processed[i] = out[j]
            tokens[i] = token
            if bad[j] and rows[i].generator is None:
                tokens[i], errors[i] = -1, "the logits hold NaN after processing"
    for i in special:
        row = rows[i]
        if row.generator is None or errors[i] is not None:
            continue
        try:
            tokens[i] = sample_row(processed.get(i, logits[i]), row.temperature, row.top_k, row.top_p,
                                   row.generator, row.min_p)
        except SamplingError as err:
            tokens[i], errors[i] = -1, str(err)
    logprobs: list[TokenLogprob | None] = [None] * n
    want = [i for i in special if rows[i].logprobs is not None and errors[i] is None]
    if want:
        entries = token_logprobs(raw[want], [tokens[i] for i in want], [rows[i].logprobs for i in want])  # type: ignore[misc]
        for i, entry in zip(want, entries, strict=True):
            logprobs[i] = entry
    return Sampled(tokens, errors, logprobs)
