"""The running batch and the two forwards that advance it (TGI's CausalLMBatch, condensed).

    prefill(new rows)   left-padded prompts, 2-D mask, explicit position ids -> fresh KV + logits
    concat(running, new)  merge KV caches by left-padding (kv.concat)
    decode(running)     one token per row: input (N, 1), mask + one column, position = row length;
                        a forward that raises leaves the batch as it was (KV rolled back)
    filter(keep)        finished / cancelled rows leave; leading all-padding columns are trimmed

Every forward first sets the routed model's adapter plan for exactly the rows it runs, so rows
of different tasks (and `base` rows) share the forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from server.engines.native import kv
from server.engines.native.detok import IncrementalDetokenizer
from server.engines.native.lora_plan import Planner
from server.engines.native.sampling import RowSampler
from server.engines.request import FinishReason, GenRequest, TokenLogprob


@dataclass
class Row:
    """One choice of one request in flight."""

    req: GenRequest
    detok: IncrementalDetokenizer
    sampler: RowSampler
    length: int  # tokens in the KV cache for this row (prompt + generated - the pending one)
    index: int = 0  # which choice of the request
    last_token: int = -1  # sampled, not yet fed back
    generated: int = 0
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
    def prefill(
        self, reqs: list[GenRequest], hidden: bool = False
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One row per request -> (cache, mask (N, T), last-position logits (N, V), and with
        `hidden` the decoder's final hidden states (N, T, d) for prompt logprobs, else None).
        Only the last position goes through the LM head either way."""
        self.planner.apply([r.adapter for r in reqs])
        ids, mask = kv.left_padded([r.prompt_ids for r in reqs], self.pad_id, self.device)
        cache = kv.new_cache()
        captured: list[torch.Tensor] = []
        hook = None
        if hidden:
            def keep(_module, _args, output):
                captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)
            hook = self.model.get_decoder().register_forward_hook(keep)
        try:
            out = self.model(
                input_ids=ids, attention_mask=mask, position_ids=kv.positions(mask),
                past_key_values=cache, use_cache=True, logits_to_keep=1,
            )
        finally:
            if hook is not None:
                hook.remove()
        return cache, mask, out.logits[:, -1, :], (captured[-1] if captured else None)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """(c, d) final hidden states of ONE row -> raw logits (c, V) (run as a batch of one row,
        the plan of a one-request prefill)."""
        return self.model.get_output_embeddings()(hidden[None])[0]

    @torch.inference_mode()
    def forward_decode(self, rows: list[Row], cache: DynamicCache, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode forward of `rows` over (cache, mask) -> (logits (N, V), mask + one column).
        Appends one position to the cache; reads the rows, changes none of them."""
        self.planner.apply([r.req.adapter for r in rows])
        n = len(rows)
        ids = torch.tensor([[r.last_token] for r in rows], dtype=torch.long, device=self.device)
        pos = torch.tensor([[r.length] for r in rows], dtype=torch.long, device=self.device)
        mask = torch.cat([mask, mask.new_ones((n, 1))], dim=1)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        return out.logits[:, -1, :], mask

    @torch.inference_mode()
    def decode(self, batch: RunningBatch) -> torch.Tensor:
        """One step for every row -> logits (N, V); the batch's cache and mask grow by one column.
        If the forward raises, the cache is rolled back and the batch is unchanged."""
        assert batch.cache is not None and batch.mask is not None
        width = batch.mask.shape[1]
        try:
            logits, batch.mask = self.forward_decode(batch.rows, batch.cache, batch.mask)
        except BaseException:
            kv.truncate(batch.cache, width)
            raise
        for r in batch.rows:
            r.length += 1
        return logits


def prefill_groups(reqs: list[GenRequest], slack: float) -> list[list[GenRequest]]:
    """Split admitted requests into prefill forwards of similar prompt length: sorted by length,
    a group grows while its padded size stays within (1 + slack) x its real tokens. (Left-padding
    a 10-token prompt to 80 would cost 8x its compute; separate forwards cost one launch each.)
    A request asking for prompt logprobs prefills alone (its forward keeps every hidden state)."""
    out: list[list[GenRequest]] = [[r] for r in reqs if r.params.prompt_logprobs is not None]
    group: list[GenRequest] = []
    real = 0
    for req in sorted((r for r in reqs if r.params.prompt_logprobs is None), key=lambda r: len(r.prompt_ids)):
        n = len(req.prompt_ids)
        if group and n * (len(group) + 1) > (1 + slack) * (real + n):
            out.append(group)
            group, real = [], 0
        group.append(req)
        real += n
    if group:
        out.append(group)
    return out
