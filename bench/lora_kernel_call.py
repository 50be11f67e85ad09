"""One call of the native LoRA kernel (server/engines/native/kernels/lora_rows.cpp), alone: the shipped
inventory's fused groups (q|k|v: 576 -> 576+192+192, three members; o: 576 -> 576, rank 8), bf16
tables and rows, for decode rows of distinct slots and for runs of one slot's tokens (a prompt
chunk). Microseconds per call and per row, medians of --repeats rounds of --calls calls.

    .venv/bin/python -m bench.lora_kernel_call --threads 2

Run from an earlier commit's tree to compare kernels (the calling convention is unchanged since
the kernel first shipped).
"""

from __future__ import annotations

import argparse
import statistics
import time

import server  # noqa: F401  (before torch: OpenMP spin defaults, server/infra/openmp.py)

# isort: split
import torch

from server.engines.native.kernels import lora_kernel

SLOTS = 16


def tables(d_in: int, widths: list[int], rank: int, dtype: torch.dtype) -> lora_kernel.TableArgs:
    k = rank * len(widths)
    starts = [sum(widths[:j]) for j in range(len(widths))]
    A = (torch.randn(SLOTS, d_in, k) * 0.05).to(dtype)
    B = torch.zeros(SLOTS, k, sum(widths))
    for j, (s, w) in enumerate(zip(starts, widths, strict=True)):
        B[:, j * rank : (j + 1) * rank, s : s + w] = torch.randn(SLOTS, rank, w) * 0.05
    return lora_kernel.TableArgs(A, B.to(dtype), list(zip(starts, widths, strict=True)), rank, d_in, sum(widths))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fn = lora_kernel.load()
    if fn is None:
        raise SystemExit(f"no LoRA kernel: {lora_kernel.error()}")
    dtype = torch.bfloat16
    groups = {"q|k|v": tables(576, [576, 192, 192], 8, dtype), "o": tables(576, [576], 8, dtype)}
    cases = [("1 decode row", 1, False), ("16 decode rows, 16 slots", 16, False),
             ("a 30-token chunk", 30, True), ("a 64-token chunk", 64, True), ("a 240-token chunk", 240, True)]
    print(f"{dtype}, {args.threads} threads, medians of {args.repeats} x {args.calls} calls; us per call (per row)")
    for label, n, one_slot in cases:
        x = torch.randn(n, 576).to(dtype)
        slots = torch.zeros(n, dtype=torch.int64) if one_slot else torch.arange(n) % SLOTS
        cells = []
        for name, g in groups.items():
            out = torch.zeros(n, g.d_out, dtype=dtype)
            for _ in range(20):
                g.rows(fn, x, out, n, slots)
            rounds = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                for _ in range(args.calls):
                    g.rows(fn, x, out, n, slots)
                rounds.append((time.perf_counter() - started) / args.calls * 1e6)
            us = statistics.median(rounds)
            cells.append(f"{name} {us:7.1f} ({us / n:5.2f})")
        print(f"  {label:26s} " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
