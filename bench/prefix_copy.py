"""What a prefix-cache hit costs against the prefill it replaces, on the default backbone: copying
a prompt's cached blocks into a row's KV slot (and out of it, when they are stored) against the
engine computing the same prompt (a request of one new token, alone, in the engine's chunks).

    .venv/bin/python -m bench.prefix_copy --tokens 512 --threads 2 --repeats 5

Prints one JSON line: the medians in milliseconds and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from adapters_store.backbone.load import load_backbone
from server.engines.dtype import serving_dtype
from server.engines.native.config import EngineConfig
from server.engines.native.core.engine import NativeEngine
from server.engines.native.core.prefix_cache import BLOCK, PrefixCache, chain, namespace
from server.engines.request import GenRequest, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bb = load_backbone("default")
    dtype = serving_dtype("cpu", None if args.dtype == "auto" else args.dtype)
    engine = NativeEngine(bb.model, bb.tokenizer, config=EngineConfig(dtype=dtype, prefix_cache_tokens=0))
    runner = engine.runner
    tokens = torch.randint(10, runner.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = PrefixCache.like(runner.kv, budget_tokens=4 * args.tokens)
    hashes = chain(namespace(None, "default", None), tokens)

    def prefill() -> None:  # one request of that prompt and one new token, alone on the engine thread
        req = engine.submit(GenRequest(list(tokens), SamplingParams(max_new_tokens=1)))
        assert req.handle.wait(600)

    def timed(fn) -> float:
        times = []
        for _ in range(args.repeats + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:]) * 1e3

    engine.start()
    try:
        forward_ms = timed(prefill)
    finally:
        engine.stop()
    runner.kv.ensure(args.tokens + 1, runner.max_positions)  # the engine gave its KV memory back when idle
    with torch.inference_mode():
        store_ms = timed(lambda: (cache.clear(), cache.store(hashes, runner.kv, 0)))
        rows = cache.match(hashes, args.tokens + 1)
        load_ms = timed(lambda: cache.load(rows, runner.kv, 1))
    print(json.dumps({"tokens": len(rows) * BLOCK, "dtype": str(runner.dtype).removeprefix("torch."),
                      "threads": args.threads, "prefill_ms": round(forward_ms, 2), "load_ms": round(load_ms, 3),
                      "store_ms": round(store_ms, 3), "prefill_over_load": round(forward_ms / load_ms, 1)}))


if __name__ == "__main__":
    main()
