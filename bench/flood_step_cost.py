"""What one engine step costs under the long-prompt flood (bench/tenant_fairness.py --flood long):
the native engine driven in this thread (no HTTP) on the default backbone, its steps timed and
sorted by what they held: decode rows only, or decode rows + prompt chunks (<= 32, <= 96, more).
The reference is one row decoding alone (the small tenant's idle step).

    flock /tmp/polyserve-bench.lock .venv/bin/python -m bench.flood_step_cost

The flood's requests here end sooner (30-120 tokens) than the benchmark's 384, so that prompts are
admitted often enough to time steps that carry them.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import server  # noqa: F401  (before torch: OpenMP spin defaults, server/infra/openmp.py)

# isort: split
import torch

from adapters_store.backbone.load import load_backbone
from server.engines.dtype import serving_dtype
from server.engines.native.config import EngineConfig
from server.engines.native.core.engine import NativeEngine
from server.engines.native.tuning import Tuning
from server.engines.request import GenRequest, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backbone", default="default")
    ap.add_argument("--steps", type=int, default=260)
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--prefill-tokens", type=int, default=0, help="POLYSERVE_TENANT_PREFILL_TOKENS (one tenant "
                    "here, so it never binds: the steps are timed as the flood alone makes them)")
    ap.add_argument("--attention-kernel", default="auto", choices=("auto", "on", "off"),
                    help="POLYSERVE_ATTENTION_KERNEL: the decode rows' attention in the native kernel, or SDPA")
    args = ap.parse_args()
    bb = load_backbone(args.backbone)
    dtype = serving_dtype("cpu", None)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, 40000) for _ in range(n)]

    print(f"dtype {dtype}, torch threads {torch.get_num_threads()}, attention kernel {args.attention_kernel}")
    with torch.inference_mode():
        config = EngineConfig(max_batch_rows=32, max_step_tokens=256, dtype=dtype,
                              tenant_prefill_tokens=args.prefill_tokens,
                              tuning=Tuning(attention_kernel=args.attention_kernel))
        alone = NativeEngine(bb.model, bb.tokenizer, None, config)
        alone.submit(GenRequest(prompt(6), SamplingParams(max_new_tokens=30, ignore_eos=True)))
        alone.step()
        alone.step()
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            alone.step()
            times.append(time.perf_counter() - t0)
        print(f"one row decoding alone: median {statistics.median(times) * 1e3:.1f} ms/step")
        eng = NativeEngine(bb.model, bb.tokenizer, None, config)
        for _ in range(24):
            eng.submit(GenRequest(prompt(args.prompt_tokens), SamplingParams(
                max_new_tokens=rng.randrange(30, 120), n=4, temperature=0.8, ignore_eos=True)))
        plan = eng.scheduler.plan_step
        last: dict[str, int] = {}

        def recording(rows, prefills):
            items, owners = plan(rows, prefills)
            last["rows"], last["prompt"] = len(rows), sum(len(i.tokens) for i in items) - len(rows)
            return items, owners

        eng.scheduler.plan_step = recording  # type: ignore[method-assign]
        buckets: dict[tuple[str, int], list[float]] = {}
        for k in range(args.steps):
            t0 = time.perf_counter()
            eng.step()
            elapsed = time.perf_counter() - t0
            if k < 4 or "rows" not in last:
                continue  # warm-up
            p = last["prompt"]
            kind = "decode only" if p == 0 else "+ <=32 prompt" if p <= 32 else "+ <=96 prompt" if p <= 96 \
                else "+ >96 prompt"
            buckets.setdefault((kind, last["rows"] // 8 * 8), []).append(elapsed)
        for (kind, rows), ts in sorted(buckets.items()):
            print(f"{kind:14s} rows {rows:2d}-{rows + 7:2d}: {len(ts):3d} steps, "
                  f"median {statistics.median(ts) * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
