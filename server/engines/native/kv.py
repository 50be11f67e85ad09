"""KV-cache surgery for continuous batching (TGI's CausalLMBatch concatenate/filter idea).

The running batch keeps one transformers DynamicCache whose layers hold keys/values of shape
(B, kv_heads, T, head_dim), plus a 2-D attention mask (B, T): rows are LEFT-padded, so every
row's newest token sits in the last column and a decode step appends one column for all rows.

    concat:  rows of two batches -> one; the shorter side is left-padded with zeros (mask 0)
    select:  keep some rows (finished rows leave; a repeated index forks a row: n choices)
    truncate: drop positions written by a forward that failed half-way (rollback)
    trim:    drop leading columns that are padding for every remaining row
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

GROW = 64  # spare positions allocated at a time


class GrowableLayer(DynamicLayer):
    """A DynamicLayer that writes new positions into a pre-allocated buffer instead of
    torch.cat-ing the whole cache every step (HF's DynamicLayer copies O(T) per token).
    `keys` / `values` are views of the filled part, so everything reading them is unchanged."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None) -> None:
        super().__init__()
        self._k = self._v = None
        self._len = 0
        if keys is not None and values is not None:
            self.dtype, self.device = keys.dtype, keys.device
            self._k, self._v, self._len = keys, values, keys.shape[-2]
            self.keys, self.values = keys, values
            self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):  # type: ignore[override]
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.is_initialized = True
        n = key_states.shape[-2]
        if self._k is None or self._len + n > self._k.shape[-2]:
            capacity = self._len + n + GROW
            shape = (*key_states.shape[:2], capacity, key_states.shape[-1])
            k = key_states.new_empty(shape)
            v = value_states.new_empty((*value_states.shape[:2], capacity, value_states.shape[-1]))
            if self._len:
                k[:, :, : self._len] = self._k[:, :, : self._len]
                v[:, :, : self._len] = self._v[:, :, : self._len]
            self._k, self._v = k, v
        self._k[:, :, self._len : self._len + n] = key_states
        self._v[:, :, self._len : self._len + n] = value_states
        self._len += n
        self.keys, self.values = self._k[:, :, : self._len], self._v[:, :, : self._len]
        return self.keys, self.values


def new_cache() -> DynamicCache:
    """An empty cache whose layers are GrowableLayers (created on first update)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowableLayer
    return cache


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def from_tensors(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A cache holding these per-layer (keys, values) without copying them."""
    cache = new_cache()
    cache.layers = [GrowableLayer(keys, values) for keys, values in kv]
    return cache


def _pad_left(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def concat(
    a_cache: DynamicCache, a_mask: torch.Tensor, b_cache: DynamicCache, b_mask: torch.Tensor
) -> tuple[DynamicCache, torch.Tensor]:
    """Rows of a then rows of b. masks: (Ba, Ta), (Bb, Tb) -> (Ba+Bb, max(Ta, Tb))."""
    length = max(a_mask.shape[1], b_mask.shape[1])
    mask = torch.cat([_pad_left(a_mask, length, 1), _pad_left(b_mask, length, 1)], dim=0)
    kv = []
    for (ak, av), (bk, bv) in zip(_layers(a_cache), _layers(b_cache), strict=True):
        kv.append((
            torch.cat([_pad_left(ak, length, 2), _pad_left(bk, length, 2)], dim=0),
            torch.cat([_pad_left(av, length, 2), _pad_left(bv, length, 2)], dim=0),
        ))
    return from_tensors(kv), mask


def select(
    cache: DynamicCache, mask: torch.Tensor, keep: torch.Tensor, min_padding: float = 0.0
) -> tuple[DynamicCache, torch.Tensor]:
    """Keep rows `keep` (index tensor); trim the leading all-padding columns of what remains
    when they are at least `min_padding` of the width (0 = always trim)."""
    mask = mask.index_select(0, keep)
    real = mask.any(dim=0)
    first = int(real.nonzero()[0]) if bool(real.any()) else mask.shape[1]
    start = first if first > 0 and first >= min_padding * mask.shape[1] else 0
    kv = [
        (k.index_select(0, keep)[:, :, start:], v.index_select(0, keep)[:, :, start:])
        for k, v in _layers(cache)
    ]
    return from_tensors(kv), mask[:, start:]


def truncate(cache: DynamicCache, length: int) -> None:
    """Forget every position at or after `length` in every layer (in place): a forward that raised
    may have appended to some layers and not others."""
    for layer in cache.layers:
        if layer.keys is None or layer.keys.shape[-2] <= length:
            continue
        if isinstance(layer, GrowableLayer):
            layer._len = length
        layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]


def left_padded(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts -> input_ids (N, T) left-padded with pad_id, attention mask (N, T)."""
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for n, p in enumerate(prompts):
        ids[n, length - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[n, length - len(p) :] = 1
    return ids.to(device), mask.to(device)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded mask (N, T): 0.. for real tokens, 0 on padding."""
    return (mask.cumsum(dim=-1) - 1).clamp(min=0)
