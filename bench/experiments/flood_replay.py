"""The long-prompt flood replayed in-process (no HTTP), every engine step timed with what it held,
and the small tenant's slowest requests listed with the steps they lived through: where
bench/tenant_fairness.py --flood long says how slow, this says why.

    flock /tmp/polyserve-bench.lock .venv/bin/python -m bench.experiments.flood_replay --prefill-tokens 32 --seconds 45

Tenant `flood` keeps 24 requests outstanding (n=4, 500-600-token prompts, 384 tokens, T=0.8; all
started together after 20 s of warm-up, as the HTTP bench's connections are); tenant `small`
starts an 8-token greedy request every 0.3 s of wall time. Default backbone, 32 rows.
"""

from __future__ import annotations

import argparse
import collections
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
from server.engines.request import GenRequest, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill-tokens", type=int, default=32, help="POLYSERVE_TENANT_PREFILL_TOKENS")
    ap.add_argument("--seconds", type=float, default=45.0, help="the mixed phase")
    args = ap.parse_args()
    budget, seconds = args.prefill_tokens, args.seconds
    bb = load_backbone("default")
    dtype = serving_dtype("cpu", None)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, 40000) for _ in range(n)]

    cfg = EngineConfig(max_batch_rows=32, max_step_tokens=256, dtype=dtype, tenant_prefill_tokens=budget)
    with torch.inference_mode():
        eng = NativeEngine(bb.model, bb.tokenizer, None, cfg)
        plan = eng.scheduler.plan_step
        last = {}

        def recording(rows, prefills):
            items, owners = plan(rows, prefills)
            last["rows"] = len(rows)
            last["prompt"] = sum(len(i.tokens) for i in items) - len(rows)
            last["resume"] = sum(
                len(i.tokens) for i, o in zip(items, owners) if getattr(o, "resume", None) is not None
            )
            return items, owners

        eng.scheduler.plan_step = recording
        flood = []

        def new_flood():
            r = GenRequest(
                prompt(rng.randrange(500, 600)),
                SamplingParams(max_new_tokens=384, n=4, temperature=0.8, ignore_eos=True),
                tenant="flood",
            )
            eng.submit(r)
            flood.append(r)

        for _ in range(24):
            new_flood()
        # warm: fill
        t_start = time.monotonic()
        while time.monotonic() - t_start < 20:
            eng.step()
            for r in list(flood):
                if r.handle.done:
                    flood.remove(r)
                    new_flood()
        small = []  # (req, t0, step index at start)
        steps = []  # (t_end, cost, rows, prompt, resume)
        done = []
        t0 = time.monotonic()
        next_small = t0
        while time.monotonic() - t0 < seconds:
            now = time.monotonic()
            while now >= next_small:
                r = GenRequest(prompt(12), SamplingParams(max_new_tokens=8, ignore_eos=True), tenant="small")
                eng.submit(r)
                small.append((r, next_small, len(steps)))
                next_small += 0.3
            ts = time.monotonic()
            eng.step()
            te = time.monotonic()
            steps.append((te, te - ts, last.get("rows"), last.get("prompt"), last.get("resume")))
            for r in list(flood):
                if r.handle.done:
                    flood.remove(r)
                    new_flood()
            for item in list(small):
                r, st, si = item
                if r.handle.done:
                    small.remove(item)
                    done.append((te - st, st, si, len(steps)))
        lat = sorted(d[0] for d in done)

        def p(q: float) -> float:
            return lat[max(0, round(q * len(lat)) - 1)]

        print(f"budget {budget}: small n={len(lat)} p50 {p(0.5):.3f} p95 {p(0.95):.3f} max {lat[-1]:.3f}")
        costs = [s[1] for s in steps]
        print(
            f"steps {len(steps)}, median {statistics.median(costs) * 1e3:.0f} ms, "
            f"p95 {sorted(costs)[int(0.95 * len(costs))] * 1e3:.0f} ms; steps/s {len(steps) / seconds:.1f}"
        )
        pr = [s for s in steps if s[3]]
        print(
            f"steps with prompt: {len(pr)}; prompt tokens total {sum(s[3] for s in steps)}, "
            f"resume tokens {sum(s[4] for s in steps)}"
        )
        by = collections.defaultdict(list)
        for s in steps:
            k = 0 if not s[3] else 32 if s[3] <= 32 else 96 if s[3] <= 96 else 999
            by[k].append(s[1])
        for k in sorted(by):
            print(f"  prompt<= {k}: {len(by[k])} steps median {statistics.median(by[k]) * 1e3:.0f} ms")
        # slow small requests: what steps they saw
        slow = sorted(done, reverse=True)[:5]
        for latv, st, si, se in slow:
            seen = steps[si:se]
            print(
                f"  slow {latv:.2f}s: {se - si} steps, sum {sum(s[1] for s in seen):.2f}s, "
                f"prompt {[s[3] for s in seen]}"
            )
        gen = sum(s[2] or 0 for s in steps)
        print(f"decode rows per second {gen / seconds:.1f}")


if __name__ == "__main__":
    main()
