"""Prompt KV kept across requests, block by block: automatic prefix caching.

A prompt's positions are cut into blocks of BLOCK tokens. Each full block is named by a hash
chain (vLLM's way, not SGLang's radix tree: a dict lookup per block, no tree to keep balanced,
and the chain already says everything a block's KV depends on):

    root      = H(namespace)                      namespace = what the KV depends on besides
                                                  the tokens: the adapter's versioned key
                                                  (server/adapter_cache: task, version, content
                                                  digest, inventory), the tenant, the cache salt
    block i   = H(block i-1, tokens[i*BLOCK : (i+1)*BLOCK])

so a block is found only under the very adapter version, tenant and salt that computed it, after
the very same tokens. SHA-256: a collision would serve another prompt's KV, and tenants choose
the tokens.

    match(hashes, tokens)   the longest chain of cached blocks, at most all but the prompt's
                            last token (the forward that follows must produce its logits);
                            peek: the same, for the scheduler's count of prompt work
    load(blocks, kv, slot)  their KV copied into the row's slot, positions 0 .. n*BLOCK - 1
    store(hashes, kv, slot) the blocks the slot now holds that the cache lacks, copied out

Rows never read the cache: a hit is copied into the row's own slot at admission (slots.py), so
the decode kernels, static decode and chunked prefill see an ordinary slot whose first positions
are already there. Copying a block costs a memcpy of its KV (about 23 KiB a token for
SmolLM2-135M in bf16) against a forward over its tokens: orders of magnitude less. Since nothing
holds a block after its copy, no block is ever in use when eviction runs.

Budget: at most `budget_tokens` // BLOCK blocks. The storage grows by doubling up to that and is
never handed back (it is the cache). Eviction is least recently used; within one prompt's chain
a parent is touched after its children, so a chain is evicted from its end, not its start.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from server.engines.native.core.slots import SlotKV

BLOCK = 16  # tokens a block (vLLM's default block size)
FIRST_BLOCKS = 64  # storage allocated on the first store; doubled as needed, up to the budget


def chain(namespace: str, tokens: Sequence[int], blocks: int | None = None,
          hashes: list[bytes] | None = None) -> list[bytes]:
    """The hashes of the first `blocks` full blocks of `tokens` (all full blocks: None), extending
    `hashes` (those of the first blocks, already computed)."""
    full = len(tokens) // BLOCK if blocks is None else min(blocks, len(tokens) // BLOCK)
    out = list(hashes or [])
    parent = out[-1] if out else hashlib.sha256(b"polyserve-prefix\0" + namespace.encode()).digest()
    for i in range(len(out), full):
        h = hashlib.sha256(parent)
        h.update(array("q", tokens[i * BLOCK : (i + 1) * BLOCK]).tobytes())
        parent = h.digest()
        out.append(parent)
    return out


def namespace(adapter_key: str | None, tenant: str, salt: str | None) -> str:
    """What a prompt's KV depends on besides its tokens (see the module docstring)."""
    return repr((adapter_key or "base", tenant, salt))


@dataclass
class CacheStats:
    evicted: int = 0  # blocks dropped for room


class PrefixCache:
    """Cached prompt blocks of one engine, in one tensor (blocks, 2 * layers, kv_heads, BLOCK, hd)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu", budget_tokens: int) -> None:
        if budget_tokens < BLOCK:
            raise ValueError(f"a prefix cache needs room for one block of {BLOCK} tokens, got {budget_tokens}")
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.max_blocks = budget_tokens // BLOCK
        self.data = torch.empty((0, 2 * layers, kv_heads, BLOCK, head_dim), dtype=dtype, device=self.device)
        self.blocks: OrderedDict[bytes, int] = OrderedDict()  # hash -> row of `data`, least recent first
        self.free: list[int] = []
        self.stats = CacheStats()

    @classmethod
    def like(cls, kv: SlotKV, budget_tokens: int) -> PrefixCache:
        return cls(kv.layers, kv.kv_heads, kv.head_dim, dtype=kv.dtype, device=kv.device, budget_tokens=budget_tokens)

    @property
    def block_bytes(self) -> int:
        return 2 * self.layers * self.kv_heads * BLOCK * self.head_dim * self.data.element_size()

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def __len__(self) -> int:
        return len(self.blocks)

    def peek(self, hashes: Sequence[bytes], prompt_tokens: int) -> list[int]:
        """Rows of the longest cached chain among `hashes`, leaving at least the prompt's last
        token to compute (nothing touched, nothing counted)."""
        found: list[int] = []
        for h in hashes[: min(len(hashes), (prompt_tokens - 1) // BLOCK)]:
            row = self.blocks.get(h)
            if row is None:
                break
            found.append(row)
        return found

    def match(self, hashes: Sequence[bytes], prompt_tokens: int) -> list[int]:
        """`peek`, touched as used (the chain's first block most recent)."""
        found = self.peek(hashes, prompt_tokens)
        self._touch(hashes[: len(found)])
        return found

    def load(self, rows: list[int], kv: SlotKV, slot: int) -> int:
        """Copy these blocks into `slot`'s positions 0 .. len(rows) * BLOCK - 1; returns that length.
        The caller has made room (kv.ensure)."""
        if not rows:
            return 0
        n = len(rows)
        got = self.data.index_select(0, torch.tensor(rows, device=self.device))  # (n, 2L, H, B, hd)
        for layer in range(self.layers):
            for which, store in enumerate((kv.k, kv.v)):
                dst = store[layer][slot, :, : n * BLOCK].view(self.kv_heads, n, BLOCK, self.head_dim)
                dst.copy_(got[:, 2 * layer + which].transpose(0, 1))
        return n * BLOCK

    def store(self, hashes: Sequence[bytes], kv: SlotKV, slot: int) -> int:
        """The slot holds the KV of the blocks `hashes` names: copy those the cache lacks (evicting
        the least recently used when full); returns how many it copied."""
        new = [i for i in range(len(hashes)) if hashes[i] not in self.blocks]
        held = sum(h in self.blocks for h in hashes)  # this chain's cached blocks: never evicted for it
        new = new[: self.max_blocks - held]  # a prompt longer than the whole cache keeps its first blocks
        if new:
            rows = self._rows(len(new), keep=set(hashes))
            index = torch.tensor(rows, device=self.device)
            first, last = new[0], new[-1] + 1  # `new` is contiguous unless another prompt shared blocks
            picks = torch.tensor([i - first for i in new], device=self.device)
            for layer in range(self.layers):
                for which, store in enumerate((kv.k, kv.v)):
                    src = store[layer][slot, :, first * BLOCK : last * BLOCK]
                    src = src.reshape(self.kv_heads, last - first, BLOCK, self.head_dim).transpose(0, 1)
                    self.data[index, 2 * layer + which] = src.index_select(0, picks)
            for i, row in zip(new, rows, strict=True):
                self.blocks[hashes[i]] = row
        self._touch(hashes)
        return len(new)

    def clear(self) -> None:
        self.free.extend(self.blocks.values())
        self.blocks.clear()

    def _touch(self, hashes: Sequence[bytes]) -> None:
        for h in reversed(hashes):  # the chain's start most recent: evicted last
            if h in self.blocks:
                self.blocks.move_to_end(h)

    def _rows(self, count: int, keep: set[bytes]) -> list[int]:
        """`count` free rows of `data`: free ones, then new storage, then the least recently used
        blocks not in `keep` (the chain being stored)."""
        while len(self.free) < count and self.data.shape[0] < self.max_blocks:
            self._grow()
        rows = [self.free.pop() for _ in range(min(count, len(self.free)))]
        while len(rows) < count:
            victim = next(h for h in self.blocks if h not in keep)
            rows.append(self.blocks.pop(victim))
            self.stats.evicted += 1
        return rows

    def _grow(self) -> None:
        old = self.data.shape[0]
        size = min(self.max_blocks, max(FIRST_BLOCKS, 2 * old))
        data = torch.empty((size, *self.data.shape[1:]), dtype=self.dtype, device=self.device)
        data[:old].copy_(self.data)
        self.data = data
        self.free.extend(range(size - 1, old - 1, -1))
