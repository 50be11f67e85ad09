"""The native engine's forward (server/engines/native/model/llama.py) with each way of running its
linears, interleaved in one process: float32 / bfloat16 x dense (F.linear: MKL or oneDNN with the
weight re-packed every call) / packed once for oneDNN. One decode step of `--rows` rows at
`--context` positions and one prefill of `--rows` x `--context` tokens each; greedy tokens of the
decode step are compared with float32 dense.

    .venv/bin/python -m bench.linear_paths --rows 16 --context 100 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import server  # noqa: F401  (before torch: OpenMP spin defaults, server/infra/openmp.py)

# isort: split
import torch

from adapters_store.backbone.load import load_backbone
from server.engines.native.core.step import Item, StepBatch
from server.engines.native.model.llama import LlamaRunner
from server.engines.native.tuning import Tuning

PATHS = {"float32 dense": (torch.float32, False), "float32 packed": (torch.float32, True),
         "bfloat16 dense": (torch.bfloat16, False), "bfloat16 packed": (torch.bfloat16, True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bb = load_backbone("default")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (args.context,), generator=gen).tolist() for _ in range(args.rows)]
    runners = {name: LlamaRunner(bb.model, dtype=dt, slots=args.rows,
                                 tuning=Tuning(packed_weights="on" if packed else "off"))
                 for name, (dt, packed) in PATHS.items()}
    prefill = StepBatch.build([Item(s, 0, tuple(p)) for s, p in enumerate(prompts)])
    decode = StepBatch.build([Item(s, args.context, (42,)) for s in range(args.rows)])
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in PATHS}
    tokens = {}
    for _ in range(args.repeats):
        for name, ex in runners.items():
            t = time.perf_counter()
            ex.forward(prefill)
            times[name][0].append(time.perf_counter() - t)
            ex.forward(decode)  # warm
            t = time.perf_counter()
            for _ in range(args.steps):
                logits = ex.forward(decode)
            times[name][1].append((time.perf_counter() - t) / args.steps)
            tokens[name] = logits.argmax(-1)
    ref_decode = statistics.median(times["float32 dense"][1])
    print(f"{args.rows} rows, {args.context} positions, {args.threads} threads (medians of {args.repeats})")
    for name, (pre, dec) in times.items():
        agree = float((tokens[name] == tokens["float32 dense"]).float().mean())
        print(f"  {name:16s} decode step {statistics.median(dec) * 1e3:7.1f} ms "
              f"(x{ref_decode / statistics.median(dec):.2f})"
              f"  prefill {statistics.median(pre) * 1e3:7.0f} ms   greedy tokens = float32 dense: {agree:.2f}")


if __name__ == "__main__":
    main()
