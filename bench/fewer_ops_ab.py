"""The decode layer with fewer ops against the path it replaced, in one process, alternating.

    before: torch's rms_norm and the rope as complex ops (POLYSERVE_ELEMENTWISE_KERNEL=off), each decode
            row's k and v copied into the cache by two indexed writes, q copied contiguous, then the
            decode attention kernel
    after:  the elementwise kernel, and the attention kernel writing k, v and reading q in place

Both engines serve the routed workload of bench/serve_bench.py in turns (the order swapping each
repeat), so the host's drift (other guests, up to 1.6x within an hour on Xeon-AMX-b) lands on both.
Reports tokens a second and this thread's CPU seconds per 1,000 tokens (all of the step's work on
one torch thread; with more, the OpenMP workers' time is not in it: compare tok/s then).

    .venv/bin/python -m bench.fewer_ops_ab --threads 1 --repeats 8
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.engine_ab import routed_workload, run_once
from server.engines.native.config import EngineConfig
from server.engines.native.core.engine import NativeEngine
from server.engines.native.core.step import StepBatch
from server.engines.native.kernels.attention_kernel import decode_attention
from server.engines.native.model import attention, llama
from server.engines.native.tuning import Tuning


def indexed_slot_attention(K: torch.Tensor, V: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           batch: StepBatch, scale: float | None = None, kernel: bool = False) -> torch.Tensor:
    """slot_attention as it was for a decode-only step on the kernel: indexed KV writes, a contiguous q."""
    n = batch.n_decode
    if not (kernel and n and not batch.chunks):
        return attention.slot_attention(K, V, q, k, v, batch, scale, kernel)
    T, heads, hd = q.shape
    out = q.new_empty((T, heads * hd))
    assert batch.decode_slots_t is not None and batch.decode_ends_t is not None
    pos = batch.positions[:n]
    K[batch.decode_slots_t, :, pos] = k[:n]
    V[batch.decode_slots_t, :, pos] = v[:n]
    decode_attention(q[:n].contiguous(), K, V, batch.decode_slots_t, batch.decode_ends_t,
                     hd**-0.5 if scale is None else scale, out[:n])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--backbone", default="default")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    turn = ["after"]

    def slot_attention(*a, **kw):  # the runner calls llama.slot_attention: the turn picks the path
        return (attention.slot_attention if turn[0] == "after" else indexed_slot_attention)(*a, **kw)

    llama.slot_attention = slot_attention  # type: ignore[assignment]
    bb, rm, adapters, jobs = routed_workload(args.backbone, 48, args.requests, 4, 128, 0)
    engines = {}
    for name, elementwise in (("before", "off"), ("after", "on")):
        turn[0] = name
        engines[name] = NativeEngine(bb.model, bb.tokenizer, rm, EngineConfig(
            max_batch_rows=16, max_batch_tokens=1 << 20, max_prefill_rows=16, max_queue=1 << 16,
            dtype=torch.bfloat16, tuning=Tuning(elementwise_kernel=elementwise)))
        run_once(engines[name], bb.tokenizer, jobs, adapters)  # warm-up
    tps: dict[str, list[float]] = {"before": [], "after": []}
    cpu: dict[str, list[float]] = {"before": [], "after": []}
    for rep in range(args.repeats):
        for name in ("before", "after") if rep % 2 == 0 else ("after", "before"):
            turn[0] = name
            tokens, wall, seconds = run_once(engines[name], bb.tokenizer, jobs, adapters)
            tps[name].append(tokens / wall)
            cpu[name].append(seconds / tokens * 1000)
            print(f"repeat {rep} {name}: {tokens / wall:.1f} tok/s, {seconds / tokens * 1000:.2f} CPU s per 1,000 "
                  "tokens", flush=True)
    ratios = [a / b for a, b in zip(cpu["after"], cpu["before"], strict=True)]
    print(f"median: before {statistics.median(tps['before']):.1f} tok/s, {statistics.median(cpu['before']):.2f} CPU s; "
          f"after {statistics.median(tps['after']):.1f} tok/s, {statistics.median(cpu['after']):.2f} CPU s; "
          f"CPU after/before per repeat {', '.join(f'{r:.2f}' for r in ratios)} "
          f"(median {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
