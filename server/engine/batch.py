"""The running batch and the two forwards that advance it (TGI's CausalLMBatch, condensed).

    prefill(new rows)   left-padded prompts, 2-D mask, explicit position ids -> fresh KV + logits
    concat(running, new)  merge KV caches by left-padding (kv.concat)
    decode(running)     one token per row: input (N, 1), mask + one column, position = row length
    filter(keep)        finished / cancelled rows leave; leading all-padding columns are trimmed

Every forward first sets the routed model's adapter plan for exactly the rows it runs, so rows
of different tasks (and `base` rows) share the forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from server.engine import kv
from server.engine.detok import IncrementalDetokenizer
from server.engine.lora_plan import Planner
from server.engine.request import FinishReason, GenRequest


@dataclass
class Row:
    req: GenRequest
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    length: int  # tokens in the KV cache for this row (prompt + generated - the pending one)
    last_token: int = -1  # sampled, not yet fed back
    generated: int = 0
    admitted_at: float = field(default_factory=time.perf_counter)
    last_token_at: float = 0.0
    finish: FinishReason | None = None


class RunningBatch:
    """Rows in flight with their shared, left-padded KV cache and attention mask (N, T)."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        return 0 if self.mask is None else self.mask.shape[1]

    def extend(self, rows: list[Row], cache: DynamicCache, mask: torch.Tensor) -> None:
        if not self.rows:
            self.rows, self.cache, self.mask = list(rows), cache, mask
            return
        assert self.cache is not None and self.mask is not None
        self.cache, self.mask = kv.concat(self.cache, self.mask, cache, mask)
        self.rows.extend(rows)

    def filter(self, keep: list[int], min_padding: float) -> None:
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self.cache, self.mask = [], None, None
            return
        assert self.cache is not None and self.mask is not None
        index = torch.tensor(keep, device=self.mask.device)
        self.cache, self.mask = kv.select(self.cache, self.mask, index, min_padding)
        self.rows = [self.rows[i] for i in keep]


class ModelRunner:
    """Runs the backbone forwards of the engine (always on the engine thread)."""

    def __init__(self, model: torch.nn.Module, planner: Planner, pad_id: int) -> None:
        self.model = model
        self.planner = planner
        self.pad_id = pad_id
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def prefill(self, rows: list[Row]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """-> (cache, mask (N, T), last-position logits (N, V))"""
        self.planner.apply([r.req.adapter for r in rows])
        ids, mask = kv.left_padded([r.req.prompt_ids for r in rows], self.pad_id, self.device)
        cache = kv.new_cache()
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=kv.positions(mask),
            past_key_values=cache, use_cache=True, logits_to_keep=1,
        )
        return cache, mask, out.logits[:, -1, :]

    @torch.inference_mode()
    def decode(self, batch: RunningBatch) -> torch.Tensor:
        """One step for every row -> logits (N, V); the batch's cache and mask grow by one column."""
        assert batch.cache is not None and batch.mask is not None
        self.planner.apply([r.req.adapter for r in batch.rows])
        n = len(batch.rows)
        ids = torch.tensor([[r.last_token] for r in batch.rows], dtype=torch.long, device=self.device)
        pos = torch.tensor([[r.length] for r in batch.rows], dtype=torch.long, device=self.device)
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((n, 1))], dim=1)
        out = self.model(
            input_ids=ids, attention_mask=batch.mask, position_ids=pos,
            past_key_values=batch.cache, use_cache=True,
        )
        for r in batch.rows:
            r.length += 1
        return out.logits[:, -1, :]
