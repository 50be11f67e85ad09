"""Data-parallel training across the processes `torchrun` starts: ranks, batch shards, gradient sums.

    torchrun --nproc_per_node N "$(which polyserve)" train ...   # RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*

Every rank draws the same global batch (the same seed drives the same Python RNG) and the Gumbel
noise of all of it, then runs forward and backward on its own contiguous slice of the rows:

    rows    = draw(B rows)                           # identical on every rank; B = --batch-size
    mine    = rows[rank * B/N : (rank + 1) * B/N]
    loss_r  = sum of CE over my target tokens / M    # M = target tokens of the whole global batch
    grad    = sum over ranks of grad(loss_r)         # one all-reduce of one flat buffer
            = grad of the one-process loss (mean CE over the global batch's M tokens)
    clip; AdamW                                      # the same numbers on every rank: weights stay equal

So the global batch, the loss, the learning-rate schedule and the number of steps are the
one-process run's; N ranks split the rows of each step.

Why the gradients are summed here rather than by DistributedDataParallel:
- the trainable parameters are few and small (the skills and the routing logits); one flat
  all-reduce a step is all DDP's buckets would do;
- DDP averages gradients over ranks, which is the one-process gradient only when every rank holds
  the same number of target tokens; summing `sum CE / M` is exact whatever the rows' lengths;
- the routed model is not one module's forward: the routing table sits outside the backbone and
  hands each forward its rows' weights through the layers' shared AdapterBatch. DDP would need a
  wrapper module, and find_unused_parameters (a graph walk every step) or a static-graph promise,
  for what a sum of `.grad` tensors does directly. (No parameter goes unused anyway: the routing
  logits are one tensor, and rows a step does not touch get zero gradient, as in one process.)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DistContext:
    """Where this process sits: rank of world_size; device it trains on; backend ("" = no group)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = ""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        """More than one rank: gradients must be summed across processes."""
        return self.world_size > 1


def env_world_size() -> int:
    """WORLD_SIZE as torchrun sets it (1 when not under torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_batch(batch_size: int, world_size: int) -> None:
    """The global batch is split evenly: refuse one the ranks cannot share."""
    if batch_size % world_size:
        raise ValueError(f"{batch_size} is not divisible by the world size {world_size}: the batch is the global "
                         f"batch, split evenly across the ranks (use a multiple of {world_size})")


def pick_device(choice: str, local_rank: int) -> torch.device:
    """auto: this rank's GPU where CUDA is available, else the CPU."""
    if choice not in DEVICES:
        raise ValueError(f"device must be one of {'|'.join(DEVICES)}, got {choice!r}")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("device cuda: no CUDA device is available")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init(device: str = "auto") -> DistContext:
    """Under torchrun: join the process group (NCCL on CUDA, gloo on CPU). Otherwise one process."""
    if not launched_by_torchrun():
        return DistContext(device=pick_device(device, 0))
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))
    where = pick_device(device, local)
    backend = "nccl" if where.type == "cuda" else "gloo"
    if where.type == "cuda":
        torch.cuda.set_device(where)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world,
                                device_id=where if where.type == "cuda" else None)
    return DistContext(rank, world, local, where, backend)


def shutdown(ctx: DistContext) -> None:
    if ctx.backend and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def session(device: str = "auto") -> Iterator[DistContext]:
    """init(), and leave the process group however the block ends."""
    ctx = init(device)
    try:
        yield ctx
    finally:
        shutdown(ctx)


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[lo, hi) of rank's contiguous share of n items; shares differ by at most one item.

    >>> [shard_bounds(5, r, 2) for r in range(2)]
    [(0, 3), (3, 5)]
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    base, extra = divmod(n, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def _flat(tensors: list[torch.Tensor], ctx: DistContext) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to(ctx.device, torch.float32) for t in tensors])


def _unflat(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def all_reduce_sum(tensors: list[torch.Tensor], ctx: DistContext) -> None:
    """Sum every tensor over the ranks, in place, with one collective over one flat buffer."""
    if not ctx.active or not tensors:
        return
    flat = _flat(tensors, ctx)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    _unflat(flat, tensors)


def all_gather_shards(mine: torch.Tensor, n: int, ctx: DistContext) -> torch.Tensor:
    """Concatenate every rank's 1-D share (as shard_bounds splits n items) into the (n,) whole."""
    if not ctx.active:
        return mine
    width = shard_bounds(n, 0, ctx.world_size)[1]  # rank 0 holds the largest share
    padded = torch.zeros(width, dtype=mine.dtype, device=ctx.device)
    padded[: mine.numel()] = mine.to(ctx.device)
    parts = [torch.empty_like(padded) for _ in range(ctx.world_size)]
    dist.all_gather(parts, padded)
    sizes = [hi - lo for lo, hi in (shard_bounds(n, r, ctx.world_size) for r in range(ctx.world_size))]
    return torch.cat([p[:s] for p, s in zip(parts, sizes, strict=True)]).to(mine.device)


def broadcast_from_main(tensors: list[torch.Tensor], ctx: DistContext) -> None:
    """Every rank takes rank 0's values (one flat broadcast)."""
    if not ctx.active or not tensors:
        return
    flat = _flat(tensors, ctx)
    dist.broadcast(flat, src=0)
    _unflat(flat, tensors)


def barrier(ctx: DistContext) -> None:
    if ctx.active:
        dist.barrier()
