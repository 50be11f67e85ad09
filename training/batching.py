"""Tokenisation and padding of supervised examples. Pure functions over token lists.

One example becomes (pseudo-code):

    prompt = tokenize(format_prompt(input))                    # with the tokenizer's own specials
    target = tokenize(format_target(output), no specials) + [eos]
    input_ids = prompt + target                                 # capped at max_length
    labels    = [-100] * len(prompt) + target                   # the loss sees only the target

A batch pads every row to the longest one, on the right (training) or on the left
(generation, so that every row's last prompt token sits at the same position), with an
attention mask (1 = real token) and label -100 on padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from adapters_store.backbone.prompt import format_prompt, format_target
from training.data import Example

IGNORE = -100
DEFAULT_MAX_LENGTH = 128  # pre-training of an inventory: the suites' examples are short
# Few-shot adaptation, retrieval and evaluation: a cap, not a length (a batch pads to its longest
# example), so short examples cost nothing more; it keeps a user's longer examples (real tasks run to
# a few hundred tokens) whole instead of training on prompts cut at the left and serving them whole.
FEW_SHOT_MAX_LENGTH = 512
Side = Literal["left", "right"]


def within_tokens(lengths: Sequence[int], max_tokens: int) -> int:
    """How many of the examples, from the front, one padded batch takes so that it holds at most
    max_tokens tokens (rows x the longest): at least one; all of them when max_tokens is 0 (no cap)."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    longest = 0
    for n, length in enumerate(lengths):
        longest = max(longest, length)
        if n and max_tokens and longest * (n + 1) > max_tokens:
            return n
    return len(lengths)


@dataclass(frozen=True)
class Encoded:
    """One tokenised example: input_ids and labels have the same length."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]

    @property
    def n_target(self) -> int:
        return sum(1 for t in self.labels if t != IGNORE)


@dataclass
class Batch:
    """input_ids, attention_mask, labels: (N, T) int64."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor

    @property
    def n_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.labels.to(device))


def encode_prompt(tokenizer: Any, text: str, context: str = "") -> list[int]:
    """Token ids of the formatted prompt for `text` (what serving feeds before generating), after
    `context` (e.g. in-context examples, training.icl) when one is given."""
    return list(tokenizer(context + format_prompt(text)).input_ids)


def encode_example(tokenizer: Any, example: Example, max_length: int = DEFAULT_MAX_LENGTH,
                   context: str = "") -> Encoded:
    """Prompt tokens masked out of the loss; target = format_target(output) + eos.

    When the pair is longer than max_length the prompt loses tokens from its left end first
    (the end of the prompt conditions the answer), then the target is cut on the right.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token; targets must end with one")
    prompt = encode_prompt(tokenizer, example.input, context)
    target = list(tokenizer(format_target(example.output), add_special_tokens=False).input_ids)
    target.append(int(tokenizer.eos_token_id))
    overflow = len(prompt) + len(target) - max_length
    if overflow > 0:
        cut = min(overflow, len(prompt) - 1)  # keep at least one prompt token
        prompt = prompt[cut:]
        target = target[: max_length - len(prompt)]
    return Encoded(tuple(prompt + target), tuple([IGNORE] * len(prompt) + target))


def encode_all(tokenizer: Any, examples: Sequence[Example], max_length: int = DEFAULT_MAX_LENGTH,
               context: str = "") -> list[Encoded]:
    return [encode_example(tokenizer, ex, max_length, context) for ex in examples]


def pad_rows(rows: Sequence[Sequence[int]], value: int, side: Side) -> torch.Tensor:
    """rows of varying length -> (N, T_max) int64 padded with `value` on `side`."""
    if side not in ("left", "right"):
        raise ValueError(f"padding side must be 'left' or 'right', got {side!r}")
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, r in enumerate(rows):
        if not r:
            continue
        t = torch.as_tensor(list(r), dtype=torch.long)
        if side == "right":
            out[i, : len(r)] = t
        else:
            out[i, width - len(r) :] = t
    return out


def collate(encoded: Sequence[Encoded], pad_id: int, side: Side = "right") -> Batch:
    """Pad a list of examples into one batch (labels -100 and mask 0 on padding)."""
    if not encoded:
        raise ValueError("cannot collate an empty batch")
    ids = pad_rows([e.input_ids for e in encoded], pad_id, side)
    mask = pad_rows([[1] * len(e.input_ids) for e in encoded], 0, side)
    labels = pad_rows([e.labels for e in encoded], IGNORE, side)
    return Batch(ids, mask, labels)


def collate_prompts(tokenizer: Any, inputs: Sequence[str], max_length: int = DEFAULT_MAX_LENGTH,
                    context: str = "") -> Batch:
    """Left-padded prompts for batched generation (labels all -100). Long prompts keep their end."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return left_padded(prompt_rows(tokenizer, inputs, max_length, context), int(pad))


def left_padded(rows: Sequence[Sequence[int]], pad_id: int) -> Batch:
    """Prompt token rows left-padded into one batch for generation (labels all -100)."""
    ids = pad_rows(rows, pad_id, "left")
    mask = pad_rows([[1] * len(r) for r in rows], 0, "left")
    return Batch(ids, mask, torch.full_like(ids, IGNORE))


def prompt_rows(tokenizer: Any, inputs: Sequence[str], max_length: int = DEFAULT_MAX_LENGTH,
                context: str = "") -> list[list[int]]:
    """Each formatted prompt's tokens after `context`; a long one keeps its end (max_length tokens)."""
    return [encode_prompt(tokenizer, text, context)[-max_length:] for text in inputs]


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens only, so left padding does not shift RoPE: (N, T)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)
