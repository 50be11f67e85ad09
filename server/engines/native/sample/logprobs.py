"""Log-probabilities of generated and prompt tokens. Pure.

    logprob(token t at a position) = log_softmax(raw logits at that position)[t]     (float32)
    top                            = the k most likely tokens there, most likely first

"Raw" = the model's own logits, before logit_bias, penalties, temperature and top-k/top-p: what
the model thinks of each token whatever the sampler did (vLLM's default `raw_logprobs`; OpenAI
documents no other). So a token forced by logit_bias can have a very low logprob, and with
greedy decoding and no processors the chosen token is always the top-1.

Prompt logprobs: the entry of prompt token i (i >= 1) is its logprob given tokens 0..i-1; the
first token has no context and gets None.
"""

from __future__ import annotations

import torch

from server.engines.request import TokenLogprob


def _entries(logprobs: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> list[TokenLogprob]:
    """logprobs (P, V) float32, tokens (P,), ks: top-k per row -> one TokenLogprob per row."""
    chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
    kmax = min(max(ks, default=0), logprobs.shape[-1])
    top_values: list[list[float]] = [[] for _ in ks]
    top_ids: list[list[int]] = [[] for _ in ks]
    if kmax > 0:
        top = logprobs.topk(kmax, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    return [
        TokenLogprob(int(t), float(c), tuple(zip(ids[:k], vals[:k], strict=True)))
        for t, c, ids, vals, k in zip(tokens.tolist(), chosen, top_ids, top_values, ks, strict=True)
    ]


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """logits (P, V) raw, the chosen token and the number of alternatives of each row."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return _entries(logprobs, torch.tensor(tokens, dtype=torch.long, device=logits.device), ks)


def prompt_chunk_logprobs(logits: torch.Tensor, ids: list[int], start: int, k: int) -> list[TokenLogprob]:
    """logits (c, V): the raw logits after prompt positions start .. start + c - 1 (one prefill
    chunk) -> the entries of the prompt tokens they predict, ids[start + 1 .. start + c], those
    that exist (the prompt's last position predicts the first generated token, not a prompt token).
    A whole prompt's list is [None] + the chunks' entries in order."""
    stop = min(start + logits.shape[0], len(ids) - 1)  # positions p in [start, stop) predict ids[p + 1]
    count = stop - start
    if count <= 0:
        return []
    logprobs = torch.log_softmax(logits[:count].float(), dim=-1)
    target = torch.tensor(ids[start + 1 : stop + 1], dtype=torch.long, device=logits.device)
    return _entries(logprobs, target, [k] * count)
