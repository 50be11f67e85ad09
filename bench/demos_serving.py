"""What a task's demonstrations cost to serve: the same routed tasks with and without 16
demonstrations, over HTTP, through one polyserve server (its prefix cache on), alternated in rounds.

Each task `T` of --tasks shipped routing tasks gets a twin `T-demos`: its routing row and 16
demonstrations (the suite's own examples of the task, training/demos.py format). Requests stream
`/v1/completions` with a formatted prompt, exactly --out tokens each (min_tokens = max_tokens, so the
newline stop a demonstration task adds cannot shorten it), --concurrency at a time, the tasks
interleaved. Prints one JSON line per (round, form) and the ratios of the medians.

    .venv/bin/python -m bench.demos_serving --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import tempfile
from pathlib import Path

import httpx

from bench.prefix_bench import run_completions, words
from bench.vllm_client_bench import start, stop


def prefix_counts(url: str) -> dict[str, float]:
    """The server's prefix-cache counters: prompt tokens looked up, and those found cached."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    names = {"query": "polyserve_prefix_cache_query_tokens_total", "hit": "polyserve_prefix_cache_hit_tokens_total"}
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        for key, name in names.items():
            if line.startswith(name):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--per-task", type=int, default=8)
    ap.add_argument("--demonstrations", type=int, default=16)
    ap.add_argument("--out", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/demos-bench"))
    args = ap.parse_args()
    args.max_concurrency = args.concurrency  # what bench.vllm_client_bench.start reads

    from adapters_store.backbone.load import hf_dir
    from adapters_store.store.directory import DirectoryStore
    from training.shipped_inventory import install_default_inventory
    from training.suite import examples, parse_task

    root = Path(tempfile.mkdtemp(prefix="demos-bench-"))
    try:
        store = DirectoryStore(root / "store")
        install_default_inventory(store)
        tasks = sorted(r.id for r in store.list_tasks() if r.status == "ready" and r.kind == "routing")
        tasks = tasks[:: max(1, len(tasks) // args.tasks)][: args.tasks]
        for t in tasks:
            demos = [{"input": e.input, "output": e.output}
                     for e in examples(parse_task(t), args.demonstrations, seed=args.seed, split="train")]
            store.put_routing(f"{t}-demos", store.load_routing(t), method="auto", demonstrations=demos)
        rng = random.Random(args.seed)
        inputs = [words(rng, 6) for _ in range(args.per_task * len(tasks))]

        def jobs(suffix: str) -> list[dict]:
            return [{"model": tasks[i % len(tasks)] + suffix, "prompt": f"Input: {text}\nOutput:",
                     "max_tokens": args.out, "min_tokens": args.out, "temperature": 0, "stream": True}
                    for i, text in enumerate(inputs)]

        args.out_dir.mkdir(parents=True, exist_ok=True)
        env = {"POLYSERVE_STORE": str(store.root)}
        proc, handle, url = start("polyserve", args, args.out_dir, env, hf_dir("default"))
        rows: dict[str, list[dict]] = {"plain": [], "demos": []}
        try:
            for suffix in ("", "-demos"):  # warm-up: each task's adapter loaded, its demonstrations' KV cached
                asyncio.run(run_completions(url, jobs(suffix)[: len(tasks)], args.concurrency))
            for r in range(args.rounds):
                for form, suffix in (("plain", ""), ("demos", "-demos")):
                    before = prefix_counts(url)
                    row = asyncio.run(run_completions(url, jobs(suffix), args.concurrency))
                    after = prefix_counts(url)
                    query, hit = (after[k] - before[k] for k in ("query", "hit"))
                    row |= {"prompt_tokens_per_request": round(query / len(inputs), 1),
                            "prefix_hit_ratio": round(hit / query, 3) if query else 0.0}
                    rows[form].append(row)
                    print(json.dumps({"round": r, "form": form, **row}), flush=True)
        finally:
            stop(proc, handle)

        def med(form: str, key: str) -> float:
            return statistics.median(x[key] for x in rows[form])

        print(json.dumps({"summary": {
            "throughput_demos_over_plain": round(med("demos", "output_tok_s") / med("plain", "output_tok_s"), 3),
            "ttft_p50_demos_over_plain": round(med("demos", "ttft_p50_s") / med("plain", "ttft_p50_s"), 3)}}),
              flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
