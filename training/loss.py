"""Causal-LM loss on target tokens only, without computing the vocabulary head on prompt tokens.

    hidden = decoder(input_ids)                     # (N, T, d)
    keep   = labels[:, 1:] != -100                  # position t predicts token t + 1
    logits = lm_head(hidden[:, :-1][keep])          # (M, V), M = number of target tokens
    loss   = mean cross-entropy over the M tokens   (HF's token-level mean)

Skipping the head on prompt and padding positions saves a large part of a small model's
step (the head of a 49k vocabulary is a fifth of SmolLM2-135M's FLOPs).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from training.batching import IGNORE, Batch


@dataclass
class TargetLogits:
    logits: torch.Tensor  # (M, V) float32
    targets: torch.Tensor  # (M,)
    rows: torch.Tensor  # (M,) the batch row of each target token
    n_rows: int


def target_logits(model: nn.Module, batch: Batch, whole_model: bool = False, past: Any = None) -> TargetLogits:
    """whole_model: call the model itself (full logits, then select) even where the decoder and the head
    could be called apart: a model sharded by FSDP gathers its root's weights only in its own forward.
    past: a transformers cache holding every row's first tokens (the batch is the rows' continuation,
    right-padded); it is extended in place."""
    batch = batch.to(next(model.parameters()).device)
    labels = batch.labels
    keep = labels[:, 1:] != IGNORE  # (N, T-1)
    mask = batch.attention_mask
    extra: dict[str, Any] = {"use_cache": False}
    if past is not None:
        seen = mask.new_ones(mask.shape[0], past.get_seq_length())
        mask = torch.cat([seen, mask], dim=1)
        extra = {cache_argument(model): past, "use_cache": True}
    decoder, head = decoder_and_head(model)
    if decoder is not None and not whole_model:  # decoder_and_head gives both or neither
        hidden = decoder(input_ids=batch.input_ids, attention_mask=mask, **extra).last_hidden_state  # (N, T, d)
        logits = head(hidden[:, :-1][keep]).float()  # (M, V)
    else:  # any other causal LM: full logits, then select
        out = model(input_ids=batch.input_ids, attention_mask=mask, **extra)
        logits = out.logits[:, :-1][keep].float()
    rows = torch.arange(labels.shape[0], device=labels.device).unsqueeze(1).expand_as(keep)[keep]
    return TargetLogits(logits, labels[:, 1:][keep], rows, labels.shape[0])


def decoder_and_head(model: nn.Module) -> tuple[Any, Any]:
    """A transformers causal LM's decoder (hidden states) and vocabulary head, to run the head on the
    positions that need logits only; (None, None) for a model that does not expose them apart."""
    hf: Any = model  # a transformers model: its methods are found by name (torch types them Tensor | Module)
    decoder = hf.get_decoder() if hasattr(hf, "get_decoder") else None
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    if decoder is None or head is None or decoder is model:
        return None, None
    return decoder, head


def cache_argument(model: nn.Module) -> str:
    """The name a transformers model's forward takes its KV cache by: `cache` in transformers 5.x,
    `past_key_values` before (the project allows both)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(output: Any) -> Any:
    """The KV cache a transformers forward returned, under either name."""
    return output.cache if "cache" in output else output.past_key_values


def token_loss(t: TargetLogits) -> torch.Tensor:
    """Mean cross-entropy over all target tokens of the batch (scalar)."""
    return F.cross_entropy(t.logits, t.targets)


def per_example_loss(t: TargetLogits) -> torch.Tensor:
    """(N,) mean cross-entropy over each row's target tokens."""
    ce = F.cross_entropy(t.logits, t.targets, reduction="none")
    return _row_mean(ce, t)


def per_example_exact(t: TargetLogits) -> torch.Tensor:
    """(N,) 1.0 where every target token of a row, its closing eos included, is the most likely one
    given the true prefix, else 0.0. Greedy decoding takes the most likely token at each position, so
    these are exactly the rows it answers word for word: exact match from the loss's own forward."""
    wrong = (t.logits.argmax(dim=-1) != t.targets).float()
    return (_row_mean(wrong, t) == 0).float()


def normalised_entropy(t: TargetLogits) -> torch.Tensor:
    """(N,) each row's mean predictive entropy over its target positions, divided by log V (in [0, 1])."""
    logp = F.log_softmax(t.logits, dim=-1)
    ent = -(logp.exp() * logp).sum(-1) / math.log(t.logits.shape[-1])  # (M,)
    return _row_mean(ent, t)


def _row_mean(values: torch.Tensor, t: TargetLogits) -> torch.Tensor:
    total = values.new_zeros(t.n_rows).index_add_(0, t.rows, values)
    count = values.new_zeros(t.n_rows).index_add_(0, t.rows, torch.ones_like(values))
    return total / count.clamp(min=1)
