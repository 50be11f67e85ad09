"""Decode steps with static shapes, replayed as CUDA graphs (a small model's decode on a GPU is
launch-bound: the CPU takes an order of magnitude longer to issue a step's kernels than the GPU to
run them; BENCHMARKS.md, "The native engine on a GPU").

A decode-only step of n rows runs as a bucket of B >= n rows (`bucket`): the B - n padding rows
feed token 0 into the spare slot (the KV cache's last slot, which no row ever gets) and their
logits are dropped; attention covers the whole KV capacity, masked by each row's length; every
row's adapter tables are gathered by slot index (base rows have zero tables, so the LoRA work
always runs). Every tensor of such a step has a shape fixed by (B, capacity), and its inputs
live in the bucket's static buffers:

    StaticDecode.run(batch)   copy the step's tokens / positions / slots / mask into the bucket's
                              buffers, then on CUDA replay the bucket's graph (captured on first
                              use, after a warm-up on a side stream); on other devices run the same
                              padded forward eagerly (how the CPU tests check it equals the
                              dynamic path). Returns the n rows' logits.
A graph reads the KV cache and the rope table by address: when either is replaced (the cache grew,
or shrank back when the engine went idle; the rope table grew), `layout()` changes and every
bucket's graph is dropped with its memory pool, to be captured again on its next use. Equal
capacities are not enough: a cache that grew and shrank back has the old capacity at new addresses.
A fresh pool goes with them: a pool whose graphs are all gone is released, and capturing into its
handle again trips the caching allocator's assert (`use_count > 0`).
Steps with prompt chunks, or more rows than the largest bucket, take the dynamic path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from server.engines.native.core.step import StepBatch

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def bucket(n: int, largest: int) -> int | None:
    """The smallest bucket that holds n rows (at most `largest`), or None."""
    return next((b for b in BUCKETS if n <= b <= largest), None)


def decode_only(batch: StepBatch) -> bool:
    """Every item feeds one token and wants its logits (no prompt chunk in the step)."""
    return not batch.chunks and all(it.logits == "last" for it in batch.items)


@dataclass
class _Bucket:
    batch: StepBatch  # static buffers in StepBatch's layout
    positions: torch.Tensor
    graph: object | None = None
    out: torch.Tensor | None = None


class StaticDecode:
    """Padded, fixed-shape decode steps for `forward(static_batch)` (the runner's compute, which
    must not allocate KV or sync with the host)."""

    def __init__(self, forward: Callable[[StepBatch], torch.Tensor], *, spare_slot: int, largest: int,
                 device: torch.device, capacity: Callable[[], int], layout: Callable[[], object]) -> None:
        """capacity(): the KV cache's positions per slot; layout(): changes whenever a tensor the
        forward reads by address (the KV cache, the rope table) is replaced."""
        self.forward, self.spare, self.largest, self.device = forward, spare_slot, largest, device
        self.capacity, self.layout = capacity, layout
        self.graphs = device.type == "cuda"
        self._buckets: dict[int, _Bucket] = {}
        self._pool: torch.cuda._POOL_HANDLE | None = None
        self._layout: object = None
        self.captures = 0

    def fits(self, batch: StepBatch) -> bool:
        return decode_only(batch) and bucket(len(batch.items), self.largest) is not None

    def _bucket(self, size: int) -> _Bucket:
        if size not in self._buckets:
            dev = self.device
            tokens = torch.zeros(size, dtype=torch.long, device=dev)
            positions = torch.zeros(size, dtype=torch.long, device=dev)
            slots = torch.full((size,), self.spare, dtype=torch.long, device=dev)
            mask = torch.zeros((size, 1, 1, self.capacity()), dtype=torch.bool, device=dev)
            static = StepBatch(items=[], tokens=tokens, positions=positions, decode=list(range(size)),
                               decode_slots=[self.spare] * size, decode_slots_t=slots, decode_contiguous=False,
                               decode_mask=mask, decode_ends_t=torch.ones(size, dtype=torch.long, device=dev),
                               chunks=[], logit_index=torch.arange(size, device=dev))
            self._buckets[size] = _Bucket(static, positions)
        return self._buckets[size]

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Logits (n, V) of a decode-only step of n rows (in batch.items order)."""
        n = len(batch.items)
        size = bucket(n, self.largest)
        assert size is not None and decode_only(batch)
        layout = self.layout()
        if layout != self._layout:
            self._drop_graphs()
            self._layout = layout
        b = self._bucket(size)
        cap = self.capacity()
        if b.batch.decode_mask is None or b.batch.decode_mask.shape[-1] != cap:
            # a new capacity is a new cache: every graph was dropped above
            b.batch.decode_mask = torch.zeros((size, 1, 1, cap), dtype=torch.bool, device=self.device)
        items = batch.items
        host = torch.tensor([[it.tokens[0], it.start, it.slot] for it in items] +
                            [[0, 0, self.spare]] * (size - n), dtype=torch.long)
        st = b.batch
        st.tokens.copy_(host[:, 0], non_blocking=True)
        st.positions.copy_(host[:, 1], non_blocking=True)
        assert st.decode_slots_t is not None and st.decode_mask is not None
        st.decode_slots_t.copy_(host[:, 2], non_blocking=True)
        visible = torch.arange(cap, device=self.device)[None, :] <= st.positions[:, None]
        st.decode_mask.copy_(visible[:, None, None, :])
        assert st.decode_ends_t is not None
        torch.add(st.positions, 1, out=st.decode_ends_t)
        st.decode_slots = [it.slot for it in items] + [self.spare] * (size - n)
        if not self.graphs:
            return self.forward(st)[:n]
        if b.graph is None:
            self._capture(b)
        b.graph.replay()  # type: ignore[attr-defined]
        assert b.out is not None
        return b.out[:n]

    def _drop_graphs(self) -> None:
        """Every graph points at replaced tensors: forget them all, and their pool."""
        for b in self._buckets.values():
            b.graph, b.out = None, None
        self._pool = None

    def _capture(self, b: _Bucket) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: allocator, cuBLAS handles, lazy kernels
                self.forward(b.batch)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            b.out = self.forward(b.batch)
        b.graph = graph
        self.captures += 1
