"""Exact match (greedy decoding, batched) and teacher-forced loss of one task's adapter.

The adapter is given as
    None                          the bare backbone
    a tensor (L, h, S)            mixing weights (already through sigmoid/normalisation)
    a list of (A_t, B_t)          per layer (d_in, r) / (r, d_out): a materialised LoRA
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from adapters_store.inject import RoutedModel
from training.batching import DEFAULT_MAX_LENGTH, collate, collate_prompts, encode_all
from training.data import Example
from training.loss import per_example_loss, target_logits

Adapter = torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]] | None


def set_plan(rm: RoutedModel, adapter: Adapter, n_rows: int) -> None:
    """Point every one of n_rows rows at the same adapter."""
    if adapter is None:
        rm.set_weights(None)
    elif isinstance(adapter, torch.Tensor):
        rm.set_materialized(adapter, rows=n_rows)
    else:
        rm.set_gathered([a.unsqueeze(0) for a, _ in adapter], [b.unsqueeze(0) for _, b in adapter],
                        torch.zeros(n_rows, dtype=torch.long))


def exact(prediction: str, reference: str) -> bool:
    return prediction.strip() == reference.strip()


@torch.no_grad()
def heldout_loss(rm: RoutedModel, adapter: Adapter, tokenizer: Any, examples: Sequence[Example],
                 batch_size: int = 16, max_length: int = DEFAULT_MAX_LENGTH, context: str = "") -> float:
    """Mean over examples of each example's mean target-token cross-entropy (after `context`, if any)."""
    encoded = encode_all(tokenizer, examples, max_length, context)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    total = 0.0
    for i in range(0, len(encoded), batch_size):
        chunk = encoded[i : i + batch_size]
        set_plan(rm, adapter, len(chunk))
        total += float(per_example_loss(target_logits(rm.model, collate(chunk, pad))).sum())
    return total / max(1, len(encoded))


@torch.no_grad()
def generate(rm: RoutedModel, adapter: Adapter, tokenizer: Any, inputs: Sequence[str], max_new_tokens: int,
             batch_size: int = 16, context: str = "", max_length: int = DEFAULT_MAX_LENGTH) -> list[str]:
    """Greedy completions of the formatted prompts, batched with left padding."""
    out: list[str] = []
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    for i in range(0, len(inputs), batch_size):
        chunk = list(inputs[i : i + batch_size])
        batch = collate_prompts(tokenizer, chunk, max_length, context)
        set_plan(rm, adapter, len(chunk))
        ids = cast(Any, rm.model).generate(  # torch types the attribute Tensor | Module
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, max_new_tokens=max_new_tokens,
            do_sample=False, num_beams=1, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id,
        )
        new = ids[:, batch.input_ids.shape[1]:]
        out += [tokenizer.decode(row, skip_special_tokens=True) for row in new]
    return out


def evaluate_task(rm: RoutedModel, adapter: Adapter, tokenizer: Any, examples: Sequence[Example],
                  batch_size: int = 16, max_new_tokens: int | None = None, context: str = "",
                  max_length: int = DEFAULT_MAX_LENGTH) -> dict[str, float]:
    """{"exact_match": fraction of greedy outputs equal to the reference, "loss": held-out CE}.

    `context` goes before every formatted prompt (in-context examples: training.icl); `max_length`
    bounds each prompt (its left end is cut), so pass a larger one with a context.

    max_new_tokens defaults to the longest reference + eos + 1: a longer output could not match.
    The RoutedModel's previous plan is restored afterwards.
    """
    if not examples:
        raise ValueError("evaluate_task needs at least one example")
    previous = rm.batch.plan
    try:
        if max_new_tokens is None:
            max_new_tokens = max(len(tokenizer(" " + ex.output, add_special_tokens=False).input_ids)
                                 for ex in examples) + 2
        preds = generate(rm, adapter, tokenizer, [ex.input for ex in examples], max_new_tokens, batch_size,
                         context, max_length)
        em = sum(exact(p, ex.output) for p, ex in zip(preds, examples, strict=True)) / len(examples)
        loss = heldout_loss(rm, adapter, tokenizer, examples, batch_size, max_length, context)
    finally:
        rm.batch.set(previous)
    return {"exact_match": em, "loss": loss}
