"""Structured outputs in the native engine: a per-row grammar matcher and the logits mask it gives.

    row admitted with SamplingParams.response_format -> RowGrammar (llguidance LLMatcher over the
                                                        grammar, engines/grammar.py); choices fork it
    every step, before sampling (sampling.sample_tokens):
        for n in constrained rows:  bits[n] = matcher[n].next_token_bitmask()    (V bits)
        logits[n, t] = -inf where bits[n, t] == 0       one masked_fill over the constrained rows
    after sampling, per row (engine._take):  consume(token) ->
        "go"    the answer goes on
        "done"  the grammar is complete: the row ends "stop" (the answer is valid JSON)
        "dead"  the token is not allowed (no token was: the grammar cannot go on) -> the row ends
                "length": an answer that is not valid is never reported complete
Unconstrained rows are not touched: they share the step and the sampler's batched path. A row
whose matcher has no allowed token is left unmasked (its next token is then refused: "dead").
Logprobs stay those of the raw logits (sampling.py); the mask works on a copy.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from server.engines.grammar import ResponseFormat, grammar_text, ll_tokenizer

Verdict = Literal["go", "done", "dead"]
_BITS = torch.arange(32, dtype=torch.int32)


class RowGrammar:
    """One choice's matcher; eos_ids: the engine's end tokens (allowed only once complete)."""

    def __init__(self, matcher: Any, vocab: int) -> None:
        self.matcher, self.vocab = matcher, vocab

    @classmethod
    def build(cls, fmt: ResponseFormat, tokenizer: Any) -> RowGrammar:
        from llguidance import LLMatcher

        tok = ll_tokenizer(tokenizer)
        matcher = LLMatcher(tok, grammar_text(fmt))
        if matcher.is_error():
            raise ValueError(f"response_format: {matcher.get_error()[:300]}")
        return cls(matcher, tok.vocab_size)

    def fork(self) -> RowGrammar:
        return RowGrammar(self.matcher.deep_copy(), self.vocab)

    def consume(self, token: int, eos: bool) -> Verdict:
        """The row sampled `token` (eos: one of the engine's end tokens)."""
        if eos:
            return "done" if self.matcher.is_accepting() else "dead"
        if self.matcher.is_error() or not self.matcher.consume_token(token) or self.matcher.is_error():
            return "dead"
        return "done" if self.matcher.is_stopped() else "go"


def bitmask(grammars: list[RowGrammar]) -> torch.Tensor:
    """(G, ceil(V/32)) int32: bit t of row g set iff token t may come next for grammars[g]."""
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    mask = allocate_token_bitmask(len(grammars), grammars[0].vocab)
    for g, grammar in enumerate(grammars):
        fill_next_token_bitmask(grammar.matcher, mask, g)
    return mask


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits (G, V') float, mask (G, W) int32 -> logits with disallowed tokens at -inf (in place).
    Tokens past the mask's 32*W bits are disallowed; a row whose mask allows nothing is left as is."""
    bits = ((mask.unsqueeze(-1) >> _BITS) & 1).reshape(mask.shape[0], -1).bool()  # (G, 32W)
    width = logits.shape[-1]
    if bits.shape[1] < width:
        bits = torch.cat([bits, bits.new_zeros(bits.shape[0], width - bits.shape[1])], dim=1)
    allowed = bits[:, :width].to(logits.device)
    empty = ~allowed.any(dim=1, keepdim=True)
    return logits.masked_fill_(~(allowed | empty), float("-inf"))


def mask_rows(logits: torch.Tensor, rows: list[int], grammars: list[RowGrammar]) -> None:
    """logits (N, V): rows[g] masked by grammars[g], in place."""
    index = torch.tensor(rows, device=logits.device)
    logits[index] = apply_bitmask(logits.index_select(0, index), bitmask(grammars))
