"""Exact match (greedy decoding, batched) and teacher-forced loss of one task's adapter.

The adapter is given as
    None                          the bare backbone
    a tensor (L, h, S)            mixing weights (already through sigmoid/normalisation)
    a list of (A_t, B_t)          per layer (d_in, r) / (r, d_out): a materialised LoRA
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F

from adapters_store.lora.inject import RoutedModel
from training.batching import (
    FEW_SHOT_MAX_LENGTH,
    IGNORE,
    Encoded,
    collate,
    encode_all,
    encode_example,
    left_padded,
    pad_rows,
    position_ids,
    prompt_rows,
)
from training.data import Example
from training.loss import (
    TargetLogits,
    cache_argument,
    decoder_and_head,
    per_example_loss,
    returned_cache,
    target_logits,
)

Adapter = torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]] | None


@dataclass(frozen=True)
class Prefix:
    """The cache of leading tokens that several prompts begin with (a context every row shares)."""
    ids: tuple[int, ...]
    cache: Any


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
                 batch_size: int = 16, max_length: int = FEW_SHOT_MAX_LENGTH, context: str = "",
                 prefix: Prefix | None = None) -> float:
    """Mean over examples of each example's mean target-token cross-entropy (after `context`, if any).
    A context the examples share runs once (shared_prompt), or not at all after `prefix` (cache_after)."""
    encoded = encode_all(tokenizer, examples, max_length, context)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    shared = shared_prompt(encoded)
    cache = cache_after(rm, adapter, encoded[0].input_ids[:shared], prefix) if shared else None
    total = 0.0
    for i in range(0, len(encoded), batch_size):
        chunk = [Encoded(e.input_ids[shared:], e.labels[shared:]) for e in encoded[i : i + batch_size]]
        set_plan(rm, adapter, len(chunk))
        past = copies(cache, len(chunk)) if cache is not None else None
        total += float(per_example_loss(target_logits(rm.model, collate(chunk, pad), past=past)).sum())
    return total / max(1, len(encoded))


@torch.no_grad()
def generate(rm: RoutedModel, adapter: Adapter, tokenizer: Any, inputs: Sequence[str], max_new_tokens: int,
             batch_size: int = 16, context: str = "", max_length: int = FEW_SHOT_MAX_LENGTH,
             prefix: Prefix | None = None) -> list[str]:
    """Greedy completions of the formatted prompts, batched with left padding. A context the prompts
    share (in-context examples) runs once, or not at all after `prefix` (cache_after), and every
    prompt continues from a copy of its cache."""
    out: list[str] = []
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    prompts = prompt_rows(tokenizer, inputs, max_length, context)
    shared = shared_prompt(as_prompts(prompts))
    cache = cache_after(rm, adapter, prompts[0][:shared], prefix) if shared else None
    for i in range(0, len(inputs), batch_size):
        chunk = prompts[i : i + batch_size]
        set_plan(rm, adapter, len(chunk))
        if cache is not None:
            new = greedy_after(rm.model, copies(cache, len(chunk)), [p[shared:] for p in chunk], max_new_tokens,
                               pad, int(tokenizer.eos_token_id))
        else:
            batch = left_padded(chunk, pad)
            ids = cast(Any, rm.model).generate(  # torch types the attribute Tensor | Module
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, max_new_tokens=max_new_tokens,
                do_sample=False, num_beams=1, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id,
            )
            new = ids[:, batch.input_ids.shape[1]:].tolist()
        out += [tokenizer.decode(row, skip_special_tokens=True) for row in new]
    return out


def greedy_after(model: Any, past: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad: int,
                 eos: int) -> list[list[int]]:
    """Greedy continuations of prompts that follow the tokens in `past` (a cache of one row per prompt),
    as transformers' generate would make them from the whole rows: the prompts left-padded (their
    padding masked, their positions counted on from the cache's), each row's tokens up to and with
    its first eos."""
    n, seen, device = len(prompts), past.get_seq_length(), next(model.parameters()).device
    ids = pad_rows(prompts, pad, "left").to(device)
    mask = torch.cat([torch.ones(n, seen, dtype=torch.long), pad_rows([[1] * len(p) for p in prompts], 0, "left")],
                     1).to(device)
    positions = seen + position_ids(mask[:, seen:])
    cache_name = cache_argument(model)
    decoder, head = decoder_and_head(model)
    rows: list[list[int]] = [[] for _ in range(n)]
    done = torch.zeros(n, dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "use_cache": True,
                  cache_name: past}
        if decoder is not None:  # the head on the last position only
            logits = head(decoder(**inputs).last_hidden_state[:, -1])
        else:
            logits = model(**inputs).logits[:, -1]
        token = logits.argmax(-1)  # a finished row runs on, its tokens unread: rows do not see each other
        for r in range(n):
            if not done[r]:
                rows[r].append(int(token[r]))
        done |= token == eos
        if bool(done.all()):
            break
        ids, positions = token.unsqueeze(1), positions[:, -1:] + 1
        mask = torch.cat([mask, mask.new_ones(n, 1)], 1)
    return rows


def evaluate_task(rm: RoutedModel, adapter: Adapter, tokenizer: Any, examples: Sequence[Example],
                  batch_size: int = 16, max_new_tokens: int | None = None, context: str = "",
                  max_length: int = FEW_SHOT_MAX_LENGTH) -> dict[str, float]:
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


CHOICE_BATCH = 16  # choices run on one copy of the prompt's cache at a time (its memory grows with them)
MIN_SHARED = 8  # tokens: a shorter common start is not worth its own forward and the cache's copies


def choice_rows(tokenizer: Any, question: str, choices: Sequence[str], context: str = "",
                max_length: int = FEW_SHOT_MAX_LENGTH) -> list[Encoded]:
    """One row per choice: the prompt and the choice's own tokens (no end of sequence after it)."""
    rows = []
    for choice in choices:
        enc = encode_example(tokenizer, Example("", question, choice), max_length, context)
        rows.append(Encoded(enc.input_ids[:-1], enc.labels[:-1]))
    return rows


@torch.no_grad()
def choice_logprobs(rm: RoutedModel, adapter: Adapter, tokenizer: Any, question: str, choices: Sequence[str],
                    context: str = "", max_length: int = FEW_SHOT_MAX_LENGTH,
                    prefix: Prefix | None = None) -> list[float]:
    """Each choice's summed log-probability as the answer to `question` (lm-eval's multiple-choice
    ranking: the choice's own tokens, not the end of sequence after it).

    The choices share their prompt: its tokens run once, and the choices continue from a copy of its
    cache, so a question with many long options costs one prompt plus the options' own tokens, not
    one prompt per option (a BIG-bench dyck_languages row: 84 options after ~450 prompt tokens).
    `prefix`, the cache of a context other questions share too (made under the same adapter), saves
    running that context again; it is used only where this question's prompt begins with its tokens."""
    rows = choice_rows(tokenizer, question, choices, context, max_length)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    shared = shared_prompt(rows)
    if shared == 0:
        set_plan(rm, adapter, len(rows))
        return _summed(target_logits(rm.model, collate(rows, pad)))
    cache = cache_after(rm, adapter, rows[0].input_ids[:shared], prefix)
    out: list[float] = []
    for start in range(0, len(rows), CHOICE_BATCH):
        part = [Encoded(r.input_ids[shared:], r.labels[shared:]) for r in rows[start:start + CHOICE_BATCH]]
        set_plan(rm, adapter, len(part))
        out += _summed(target_logits(rm.model, collate(part, pad), past=copies(cache, len(part))))
    return out


def shared_prompt(rows: Sequence[Encoded]) -> int:
    """How many leading tokens every row has in common and can run once: the longest common prefix,
    short of each row's last prompt token (whose logit scores the row's first answer token). 0 where
    sharing is not worth a second forward (a single row, or fewer than MIN_SHARED tokens in common)."""
    if len(rows) < 2:
        return 0
    first_answer = min(next((i for i, y in enumerate(r.labels) if y != IGNORE), len(r.labels)) for r in rows)
    common = 0
    while common < first_answer - 1 and all(r.input_ids[common] == rows[0].input_ids[common] for r in rows):
        common += 1
    return common if common >= MIN_SHARED else 0


def as_prompts(prompts: Sequence[Sequence[int]]) -> list[Encoded]:
    """Prompt tokens as rows with no answer yet, for shared_prompt."""
    return [Encoded(tuple(p), (IGNORE,) * len(p)) for p in prompts]


def prompt_cache(rm: RoutedModel, adapter: Adapter, ids: Sequence[int], past: Any = None) -> Any:
    """The KV cache of one row of tokens under `adapter` (after the tokens in `past`, which it extends)."""
    if past is not None and not ids:
        return past
    set_plan(rm, adapter, 1)
    row = torch.tensor([list(ids)], device=next(rm.model.parameters()).device)
    decoder, _ = decoder_and_head(rm.model)  # no logits: a long context's would be most of the work
    inputs: dict[str, Any] = {"input_ids": row, "use_cache": True}
    if past is not None:
        inputs[cache_argument(rm.model)] = past
    return returned_cache((decoder or rm.model)(**inputs))


def cache_after(rm: RoutedModel, adapter: Adapter, ids: Sequence[int], prefix: Prefix | None) -> Any:
    """The KV cache of one row of tokens, continuing from a copy of `prefix`'s cache where the row
    begins with its tokens (the prefix must have been made under the same adapter), else from nothing."""
    n = len(prefix.ids) if prefix is not None else 0
    if prefix is not None and n <= len(ids) and tuple(ids[:n]) == prefix.ids:
        return prompt_cache(rm, adapter, ids[n:], copies(prefix.cache, 1))
    return prompt_cache(rm, adapter, ids)


def copies(cache: Any, n: int) -> Any:
    """n rows that each start from `cache` (a copy: a forward extends its cache in place)."""
    past = copy.deepcopy(cache)
    past.batch_repeat_interleave(n)
    return past


def _summed(t: TargetLogits) -> list[float]:
    """Each row's summed log-probability of its target tokens."""
    logp = -F.cross_entropy(t.logits, t.targets, reduction="none")
    return logp.new_zeros(t.n_rows).index_add_(0, t.rows, logp).tolist()


def score_rows(rm: RoutedModel, adapter: Adapter, tokenizer: Any, rows: Sequence[dict[str, Any]],
               context: str = "", max_length: int = FEW_SHOT_MAX_LENGTH, batch_size: int = 16,
               first_line: bool = False) -> dict[str, float]:
    """Suite rows with several right answers or choices (training.bigbench): {"exact_match": the greedy
    answer equals one of the row's targets, "ll_acc": the best-ranked choice is the answer (rows with
    choices only), "loss"}. first_line: the answer ends at its first newline, as a server ends one
    after a task's demonstrations (its stop string). The RoutedModel's previous plan is restored."""
    if not rows:
        raise ValueError("score_rows needs at least one row")
    examples = [Example(str(r.get("task", "")), r["input"], r["output"]) for r in rows]
    previous = rm.batch.plan
    try:
        answers = [list(r.get("targets") or [r["output"]]) for r in rows]
        longest = max(len(tokenizer(" " + a, add_special_tokens=False).input_ids) for ans in answers for a in ans)
        prefix = context_prefix(rm, adapter, tokenizer, [ex.input for ex in examples], context, max_length)
        preds = generate(rm, adapter, tokenizer, [ex.input for ex in examples], longest + 2, batch_size,
                         context, max_length, prefix)
        if first_line:
            preds = [p.split("\n", 1)[0] for p in preds]
        out = {"exact_match": sum(any(exact(p, a) for a in ans) for p, ans in zip(preds, answers, strict=True))
               / len(rows)}
        ranked = [r for r in rows if r.get("choices")]
        if ranked:
            hits = 0
            for r in ranked:
                lp = choice_logprobs(rm, adapter, tokenizer, r["input"], r["choices"], context, max_length, prefix)
                hits += r["choices"][max(range(len(lp)), key=lp.__getitem__)] == r["output"]
            out["ll_acc"] = hits / len(ranked)
        out["loss"] = heldout_loss(rm, adapter, tokenizer, examples, batch_size, max_length, context, prefix)
    finally:
        rm.batch.set(previous)
    return out


@torch.no_grad()
def context_prefix(rm: RoutedModel, adapter: Adapter, tokenizer: Any, inputs: Sequence[str],
                   context: str, max_length: int) -> Prefix | None:
    """The cache of the leading tokens that the prompts of all `inputs` share (in-context examples),
    so that generation, the choices' ranking and the loss each run only their rows' own tokens after
    it; None where the prompts share too little (shared_prompt). A row whose prompt lost its left end
    to max_length does not begin with it and runs whole (cache_after)."""
    if not context or len(inputs) < 2:
        return None
    prompts = prompt_rows(tokenizer, inputs, max_length, context)
    shared = shared_prompt(as_prompts(prompts))
    if shared == 0:
        return None
    ids = tuple(prompts[0][:shared])
    return Prefix(ids, prompt_cache(rm, adapter, ids))
