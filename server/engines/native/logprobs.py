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

from collections.abc import Callable

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


def prompt_logprobs(
    hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], ids: list[int], k: int,
    *, last_logits: torch.Tensor | None = None, chunk: int = 256,
) -> list[TokenLogprob | None]:
    """hidden (L, d): the decoder's final hidden states of one prompt of L = len(ids) tokens;
    head: (c, d) -> (c, V) raw logits (the LM head). Positions are done `chunk` at a time, so
    memory stays at chunk x V however long the prompt.

    last_logits (V,): the logits the model itself returned for the last position. When given,
    head(hidden[-1]) must match it, or the backbone post-processes its logits (softcapping,
    scaling) in a way head() does not reproduce, and a ValueError is raised rather than
    reporting wrong numbers."""
    if hidden.shape[0] != len(ids):
        raise ValueError(f"hidden has {hidden.shape[0]} positions for {len(ids)} prompt tokens")
    if last_logits is not None:
        mine = head(hidden[-1:]).float()[0]
        if not torch.allclose(mine, last_logits.float(), rtol=1e-3, atol=1e-3):
            raise ValueError("prompt_logprobs: this backbone post-processes its logits; not supported")
    out: list[TokenLogprob | None] = [None]
    target = torch.tensor(ids, dtype=torch.long, device=hidden.device)
    for start in range(0, len(ids) - 1, chunk):
        stop = min(start + chunk, len(ids) - 1)
        logprobs = torch.log_softmax(head(hidden[start:stop]).float(), dim=-1)  # predicts ids[start+1:stop+1]
        out.extend(_entries(logprobs, target[start + 1 : stop + 1], [k] * (stop - start)))
    return out
