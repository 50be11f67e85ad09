"""The rows of one request (its n choices) and the sampling of a step over rows.

    Row                 one choice in flight: its KV slot, length, sampler, detokenizer
    new_rows(req)       choice i: its own detokenizer, processors state (fork) and generator,
                        seeded with seed + i when the request has a seed
    sample_rows(rows)   sampling.sample_tokens over the batch; if that raises, row by row, so
                        only a row that fails alone fails
    stop_token(...)     whether a generated token ends its choice (EOS unless ignore_eos, or one
                        of stop_token_ids; never before min_tokens, as in vLLM)
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from server.engines.native.sample.detok import IncrementalDetokenizer
from server.engines.native.sample.grammar_mask import RowGrammar
from server.engines.native.sample.processors import RowProcessors
from server.engines.native.sample.sampling import RowSampler, Sampled, sample_tokens
from server.engines.request import FinishReason, GenRequest, SamplingParams, TokenLogprob

log = logging.getLogger("polyserve.engine")

SEED_MASK = (1 << 64) - 1  # torch generators take 64-bit seeds


@dataclass(eq=False)
class Row:
    """One choice of one request in flight (decoding)."""

    req: GenRequest
    detok: IncrementalDetokenizer
    sampler: RowSampler
    length: int  # positions in the row's KV slot (prompt + generated - the pending token)
    index: int = 0  # which choice of the request
    slot: int = -1  # its KV slot (moves when a lower slot is freed)
    last_token: int = -1  # sampled, not yet fed back
    generated: int = 0
    generated_ids: list[int] = field(default_factory=list)  # to recompute its KV after a preemption
    admitted_at: float = field(default_factory=time.perf_counter)
    last_token_at: float = 0.0
    finish: FinishReason | None = None
    pending_logprobs: list[TokenLogprob] | None = None  # not yet sent; None = not asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def take_logprobs(self) -> list[TokenLogprob] | None:
        out = self.pending_logprobs
        if out is not None:
            self.pending_logprobs = []
        return out


def describe(err: BaseException) -> str:
    """A short description of an error for a row's FinalEvent.error."""
    return f"{type(err).__name__}: {err}"[:300]


def stop_token(params: SamplingParams, token: int, generated: int, eos_ids: frozenset[int]) -> bool:
    """Whether the `generated`-th token `token` ends its choice with finish reason "stop"."""
    if generated <= params.min_tokens:
        return False  # masked before sampling (processors.py); a forced one does not stop either
    return token in params.stop_token_ids or (token in eos_ids and not params.ignore_eos)


def new_rows(req: GenRequest, tokenizer: Any, vocab: int, device: torch.device,
             prompt_lp: list[TokenLogprob | None] | None = None, eos_ids: frozenset[int] = frozenset()) -> list[Row]:
    """The n choices of a request: choice i of a seeded request samples with seed + i."""
    p = req.params
    procs = RowProcessors.build(p, req.prompt_ids, vocab, device, eos_ids)
    grammar = RowGrammar.build(p.response_format, tokenizer) if p.response_format is not None else None
    rows = []
    for index in range(p.n):
        gen = None
        if not p.greedy:
            seed = (p.seed + index) & SEED_MASK if p.seed is not None else secrets.randbits(63)
            gen = torch.Generator().manual_seed(seed)
        sampler = RowSampler(p.temperature, p.top_k, p.top_p, gen,
                             None if procs is None else (procs if index == 0 else procs.fork()), p.logprobs, p.min_p,
                             None if grammar is None else (grammar if index == 0 else grammar.fork()))
        detok = IncrementalDetokenizer(tokenizer, req.prompt_ids, p.stop, skip_special_tokens=p.skip_special_tokens,
                                       include_stop=p.include_stop_str_in_output, min_tokens=p.min_tokens)
        rows.append(Row(req, detok, sampler, length=len(req.prompt_ids), index=index,
                        pending_logprobs=None if p.logprobs is None else [], prompt_logprobs=prompt_lp))
    return rows


def sample_rows(rows: list[Row], logits: torch.Tensor) -> Sampled:
    """Batched sampling; if that raises, row by row, so only a row that fails alone fails."""
    samplers = [r.sampler for r in rows]
    try:
        return sample_tokens(logits, samplers)
    except Exception:
        log.exception("batched sampling failed; sampling row by row")
    out = Sampled([], [], [])
    for i, sampler in enumerate(samplers):
        try:
            one = sample_tokens(logits[i : i + 1], [sampler])
        except Exception as err:  # noqa: BLE001 - fails this row only
            one = Sampled([-1], [f"sampling failed: {describe(err)}"], [None])
        out.tokens += one.tokens
        out.errors += one.errors
        out.logprobs += one.logprobs
    return out


def vocab_size(model: torch.nn.Module) -> int:
    """Width of the logits (the LM head's rows; config.vocab_size when there is no head)."""
    hf: Any = model  # a transformers model, read by name (torch types its attributes Tensor | Module)
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None else int(hf.config.vocab_size)
