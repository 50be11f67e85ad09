"""A step's rows split over lanes: threads that each run their share of the items through the whole
model on one OpenMP thread, side by side, and meet once, when the step's logits are put together.

Why (server/infra/contention.py): once other processes want the same CPUs, a team of OpenMP
threads loses its time at the barrier that ends each of a step's hundreds of parallel ops, where
its members wait for one that is descheduled. One thread has no barrier, but the scheduler gives
it one runnable thread's share of the CPUs. Lanes have no barrier inside the step either, and get
one share each. What they pay: every lane reads all the weights, its GEMMs are narrower, and the
Python between two ops holds the GIL one lane at a time; with the CPUs to itself the team is the
faster of the two (docs/history/openmp-threads.md has the figures).

Items of one step are independent: each writes only its own slot's KV positions and reads only its
own slot's adapter tables, so lanes share the cache and the tables without a lock. The one
allocation a step may make (the KV cache and the rope table growing) happens before the lanes start.

    lanes_pay(weight_kernel, dtype, helper)  whether lanes beat one thread on this CPU and weights ("auto")
    partition(sizes, lanes)          items to lanes, balanced by tokens (pure)
    Lanes(n).run(batch, fn)          fn(sub-batch) on each lane (the calling thread is lane 0), the
                                     logits back in the batch's order
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from adapters_store.backbone.hardware import cpu_has_amx, cpu_has_avx512
from server.engines.native.core.step import StepBatch
from server.infra import openmp


def lanes_pay(weight_kernel: bool = False, dtype: torch.dtype = torch.float32,
              helper: bool = False) -> tuple[bool, str]:
    """Whether a contended step runs on lanes rather than on one thread, on this CPU, and why.
    weight_kernel: the runner's linears read the backbone's GGUF blocks (quant_linear.py), serving
    `dtype`; helper: the one thread's linears would share their panels with the weight kernel's
    panel helper (panel_helper.h).

    With the helper, one thread beat lanes beside a few busy processes in float32 and in bf16 (a
    second runnable thread for the linears, no weight dequantised twice) and tied or lost beside
    many, which `deep_lanes_pay` covers.

    Lanes get more of the CPUs than one thread but spend more CPU per token (each reads all the
    weights for half the rows). That pays where a step's GEMMs are bound by arithmetic, and not
    where they are bound by reading the weights: measured beside busy processes, lanes gained on
    an AVX2-only CPU and lost or tied on AVX-512 ones (with and without AMX), in float32 as in bfloat16,
    on dense weights. On the GGUF blocks in float32 a lane reads a fifth of the bytes, and lanes were
    ahead on an AVX-512 CPU too (docs/history/openmp-threads.md, "Lanes"); in bf16 on the blocks a
    lane dequantises every tile whatever its rows, as a dense one reads every weight, and bf16 needs
    AVX-512. Where this says no, the engine still runs lanes while contention is deep
    (server/infra/contention.py) where `deep_lanes_pay` says so."""
    if helper:
        return False, "the panel helper shares the linears' panels: no weight is dequantised twice"
    if weight_kernel and dtype == torch.float32:
        return True, "the linears read the GGUF blocks: a second lane's weight reads cost little"
    if cpu_has_avx512():
        return False, "the CPU has AVX-512: lanes' extra work costs more than their share of the CPUs gains"
    return True, "the CPU has no AVX-512: lanes' share of the CPUs outweighs their extra work"


def deep_lanes_pay(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether, where `lanes_pay` says no, a step runs on lanes while contention is deep (the one
    thread holds under half a CPU), serving in `dtype`, and why.

    There two lanes hold more of the CPUs than one thread (each is a runnable thread of its own)
    at more CPU a token: that paid on an AVX-512 bf16 CPU without AMX, on dense weights and on the
    blocks (BENCHMARKS.md, "In bf16 without AMX"). With bf16 GEMMs on AMX a
    lane's half of the rows costs nearly a whole step (the GEMMs are bound by reading the weights),
    and once one thread's step had fewer ops the lanes lost to it there (figures:
    docs/history/openmp-threads.md, "Lanes under deep contention on AMX")."""
    if dtype == torch.bfloat16 and cpu_has_amx():
        return False, "bf16 on AMX: a lane of half the rows costs nearly a whole step"
    return True, "lanes' share of the CPUs outweighs their extra work once one thread holds under half a CPU"


def partition(sizes: list[int], lanes: int) -> list[list[int]]:
    """Item indices per lane (each list ascending, no empty lane): largest item first, each to the
    lane with the fewest tokens so far (ties: the lower lane). A step's cost is close to linear in
    its tokens; a decode row's context length is left out (its attention is a small part)."""
    if lanes < 1:
        raise ValueError(f"lanes must be at least 1, got {lanes}")
    parts: list[list[int]] = [[] for _ in range(lanes)]
    load = [0] * lanes
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        lane = min(range(lanes), key=lambda j: (load[j], j))
        parts[lane].append(i)
        load[lane] += sizes[i]
    return [sorted(p) for p in parts if p]


def logit_positions(batch: StepBatch, items: list[int]) -> list[int]:
    """Rows of the batch's logits that belong to `items` (in order): where a sub-batch over those
    items puts its logits, row for row."""
    return [r for i in items for r in range(batch.logit_rows[i].start, batch.logit_rows[i].stop)]


class Lanes:
    """n lanes: the calling thread and n - 1 helper threads, each running torch on one thread (no
    OpenMP pool of its own: server/infra/openmp.py)."""

    def __init__(self, n: int) -> None:
        if n < 2:
            raise ValueError(f"lanes need at least 2 threads, got {n}")
        self.n = n
        self._pool = ThreadPoolExecutor(n - 1, thread_name_prefix="polyserve-lane", initializer=openmp.one_thread)

    def run(self, batch: StepBatch, compute: Callable[[StepBatch], torch.Tensor]) -> torch.Tensor:
        """compute(sub-batch) -> (R_sub, V) logits, for each lane's share of the batch's items;
        returns (R, V) in the batch's logit order. An item too few to share runs here alone. A
        lane's exception is raised here, after every lane has finished (none is left writing)."""
        parts = partition([len(it.tokens) for it in batch.items], self.n)
        if len(parts) == 1:
            return compute(batch)
        subs = [batch.subset(p) for p in parts]
        futures: list[Future[torch.Tensor]] = [self._pool.submit(_in_inference_mode, compute, s) for s in subs[1:]]
        try:
            first = compute(subs[0])
        finally:
            errors = [f.exception() for f in futures]  # waits for every helper lane
        for err in errors:
            if err is not None:
                raise err
        outs = [first] + [f.result() for f in futures]
        logits = first.new_empty((int(batch.logit_index.numel()), first.shape[1]))
        for part, out in zip(parts, outs, strict=True):
            if out.shape[0]:
                index = torch.tensor(logit_positions(batch, part), dtype=torch.long, device=out.device)
                logits.index_copy_(0, index, out)
        return logits

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _in_inference_mode(compute: Callable[[StepBatch], torch.Tensor], batch: StepBatch) -> torch.Tensor:
    with torch.inference_mode():  # per thread: the engine thread's mode does not reach a helper
        return compute(batch)
