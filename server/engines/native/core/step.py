"""What one forward of the native engine runs: a flat batch of tokens from several rows.

Every row in flight owns a KV slot. A forward feeds, per row, the tokens that follow what its
slot already holds: one token for a decoding row, a chunk of the prompt for a prefilling row
(chunked prefill: a long prompt is split over several steps so decoding rows never wait for it).

    items[i] = Item(slot, start, tokens, logits)
        slot     the row's KV slot; `start` = positions already in it (the first new token's position)
        tokens   the new tokens (written to the slot at start .. start + len - 1)
        logits   "last": the logits after the last token (sampling), "all": after every token
                 (prompt logprobs), "none": no logits (a prompt chunk that is not the last)

Layout (built once per step, shared by every layer):

    flat tokens = [single-token items (the decode group), ordered by slot] + [multi-token chunks]
    decode group: one batched attention over slots; mask[n, j] = j < start_n + 1
    chunks:       one attention each, causal within the chunk, over the slot's start + len positions
    logit_index:  the flat positions whose logits are wanted, item by item (in `items` order)

An item with one token IS a decode step, whether it came from decoding or from a one-token
prompt chunk: it attends to its slot's positions 0..start, as a decode does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

LogitsWanted = Literal["last", "all", "none"]


@dataclass(frozen=True)
class Item:
    slot: int
    start: int
    tokens: tuple[int, ...]
    logits: LogitsWanted = "last"

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError("an item feeds at least one token")
        if self.start < 0 or self.slot < 0:
            raise ValueError(f"bad item: slot {self.slot}, start {self.start}")

    @property
    def end(self) -> int:
        """KV positions the slot holds after this item."""
        return self.start + len(self.tokens)


@dataclass
class Chunk:
    """A multi-token item inside the flat batch: tokens [offset, offset + length)."""

    item: Item
    offset: int
    mask: torch.Tensor | None  # (length, start + length) bool; None = plain causal (start == 0)


@dataclass
class StepBatch:
    items: list[Item]
    tokens: torch.Tensor  # (T,) long
    positions: torch.Tensor  # (T,) long
    decode: list[int]  # indices into items of the decode group, in flat order (sorted by slot)
    decode_slots: list[int]
    decode_slots_t: torch.Tensor | None  # (N_d,) long
    decode_contiguous: bool  # decode_slots == [0, 1, .., N_d - 1]: slot tables/KV are plain views
    decode_mask: torch.Tensor | None  # (N_d, 1, 1, L) bool, L = longest decode context
    decode_ends_t: torch.Tensor | None  # (N_d,) long: each decode row's context length (start + 1)
    chunks: list[Chunk]
    logit_index: torch.Tensor  # (R,) long flat positions
    logit_rows: list[slice] = field(default_factory=list)  # per item: its rows of the logits

    @property
    def n_decode(self) -> int:
        return len(self.decode)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def attention_length(self) -> int:
        """Longest context any item attends to (the KV capacity the step needs)."""
        return max(it.end for it in self.items)

    @classmethod
    def build(cls, items: list[Item], device: torch.device | str = "cpu") -> StepBatch:
        if not items:
            raise ValueError("a step needs at least one item")
        slots = [it.slot for it in items]
        if len(set(slots)) != len(slots):
            raise ValueError(f"two items share a slot: {slots}")
        decode = sorted((i for i, it in enumerate(items) if len(it.tokens) == 1), key=lambda i: items[i].slot)
        multi = [i for i, it in enumerate(items) if len(it.tokens) > 1]
        tokens: list[int] = []
        positions: list[int] = []
        flat_start: dict[int, int] = {}
        for i in decode:
            flat_start[i] = len(tokens)
            tokens.append(items[i].tokens[0])
            positions.append(items[i].start)
        chunks = []
        for i in multi:
            it = items[i]
            flat_start[i] = len(tokens)
            tokens.extend(it.tokens)
            positions.extend(range(it.start, it.end))
            chunks.append(Chunk(it, flat_start[i], _chunk_mask(it.start, len(it.tokens), device)))
        index: list[int] = []
        rows: list[slice] = []
        for i, it in enumerate(items):
            first = len(index)
            if it.logits == "last":
                index.append(flat_start[i] + len(it.tokens) - 1)
            elif it.logits == "all":
                index.extend(range(flat_start[i], flat_start[i] + len(it.tokens)))
            rows.append(slice(first, len(index)))
        decode_slots = [items[i].slot for i in decode]
        slots_t = mask = ends = None
        if decode:
            slots_t = torch.tensor(decode_slots, dtype=torch.long, device=device)
            ends = torch.tensor([items[i].end for i in decode], dtype=torch.long, device=device)
            width = int(max(items[i].end for i in decode))
            mask = (torch.arange(width, device=device)[None, :] < ends[:, None])[:, None, None, :]
        return cls(
            items=items,
            tokens=torch.tensor(tokens, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            decode=decode, decode_slots=decode_slots, decode_slots_t=slots_t,
            decode_contiguous=decode_slots == list(range(len(decode))),
            decode_mask=mask, decode_ends_t=ends, chunks=chunks,
            logit_index=torch.tensor(index, dtype=torch.long, device=device), logit_rows=rows,
        )

    def subset(self, keep: list[int]) -> StepBatch:
        """The same step over items[keep] only (fault isolation probes and retries)."""
        return StepBatch.build([self.items[i] for i in keep], self.tokens.device)


def _chunk_mask(start: int, length: int, device: torch.device | str) -> torch.Tensor | None:
    """Token i of a chunk (position start + i) sees positions 0 .. start + i."""
    if start == 0:
        return None
    q = torch.arange(length, device=device)[:, None] + start
    return torch.arange(start + length, device=device)[None, :] <= q
