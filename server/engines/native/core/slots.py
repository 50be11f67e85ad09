"""KV slots: every row in flight owns one slot of a pre-allocated KV cache.

    SlotKV      k[l], v[l]: (slots, kv_heads, capacity, head_dim) per layer. A row's position p
                lives at [slot, :, p]; nothing moves when rows join or leave (no left-padding,
                no concatenation). Capacity grows (doubling, contents kept) when a row needs
                more positions, and shrinks back when the engine is idle.
    SlotPool    which slots are taken. Slots in use are kept dense, 0 .. n-1: freeing slot s
                while a higher slot m is in use moves m's row down into s (`free` returns that
                move; the caller copies the KV and adapter tables). Dense slots make the decode
                group's KV and LoRA tables plain views ([:n]) instead of per-step gathers.

A forward writes a row's new positions before they are committed; the engine advances a row's
length only after the whole step succeeded, so a failed forward leaves nothing to roll back.
"""

from __future__ import annotations

import torch

MIN_CAPACITY = 128


class SlotKV:
    def __init__(self, layers: int, slots: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu", capacity: int = MIN_CAPACITY) -> None:
        if slots < 1 or layers < 1:
            raise ValueError(f"need at least one slot and one layer, got {slots} slots, {layers} layers")
        self.layers, self.slots, self.kv_heads, self.head_dim = layers, slots, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.version = 0  # bumped whenever the tensors are replaced (a CUDA graph reads them by address)
        self._allocate(max(capacity, 1))

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def nbytes(self) -> int:
        return 2 * sum(t.numel() * t.element_size() for t in self.k)

    def _allocate(self, capacity: int, keep: int = 0) -> None:
        shape = (self.slots, self.kv_heads, capacity, self.head_dim)
        k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        for old, new in ((self.k, k), (self.v, v)):
            for a, b in zip(old, new, strict=False):
                b[:, :, :keep].copy_(a[:, :, :keep])
        self.k, self.v = k, v
        self.version += 1

    def ensure(self, length: int, limit: int | None = None) -> bool:
        """Room for `length` positions per slot (doubling, at most `limit`); returns whether it grew."""
        if length <= self.capacity:
            return False
        if limit is not None and length > limit:
            raise ValueError(f"{length} positions exceed the model's {limit}")
        capacity = self.capacity
        while capacity < length:
            capacity *= 2
        if limit is not None:
            capacity = min(capacity, limit)
        self._allocate(capacity, keep=self.capacity)
        return True

    def reset(self, capacity: int = MIN_CAPACITY) -> None:
        """Idle: give the memory of a long row back."""
        if self.capacity > capacity:
            self._allocate(capacity)

    def copy(self, src: int, dst: int, length: int) -> None:
        """Slot dst gets src's first `length` positions (a forked choice, a compaction move)."""
        if src == dst or length <= 0:
            return
        for t in (*self.k, *self.v):
            t[dst, :, :length].copy_(t[src, :, :length])


class SlotPool:
    """Dense slot allocation: slots in use are always 0 .. used - 1, each with its holder (the
    row or prefilling request that owns it; several slots may share a holder)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.holders: list[object] = []

    @property
    def used(self) -> int:
        return len(self.holders)

    @property
    def free_slots(self) -> int:
        return self.slots - self.used

    def take(self, holder: object, count: int = 1) -> list[int]:
        if count > self.free_slots:
            raise RuntimeError(f"{count} slots asked, {self.free_slots} free")
        first = self.used
        self.holders.extend([holder] * count)
        return list(range(first, first + count))

    def free(self, slot: int) -> tuple[int, int, object] | None:
        """Release `slot`. When a higher slot is in use, its holder moves down into `slot`: returns
        (src, dst, holder); the caller copies the slot's data and updates the holder."""
        if not 0 <= slot < self.used:
            raise RuntimeError(f"slot {slot} is not in use (used: {self.used})")
        last = self.used - 1
        moved = self.holders.pop()
        if slot == last:
            return None
        self.holders[slot] = moved
        return last, slot, moved
