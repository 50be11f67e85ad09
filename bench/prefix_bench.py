"""Prompts that repeat their front, over HTTP: polyserve's server against vLLM's OpenAI server
(its prefix cache on), the same request bodies to both, one server after the other in one run.

Workloads (each request streams, so TTFT is the first chunk with text; EOS ignored):
    shared   --tasks routed tasks, each with its own prefix of --prefix-words words; --per-task
             requests a task, each the prefix + a new --question-words-word input; --out tokens;
             --concurrency at once, the tasks interleaved
    unique   the control: the same lengths, every request a prefix of its own
    chat     `base` through /v1/chat/completions: --conversations conversations of --turns turns,
             --chat-concurrency at a time; each turn's prompt is the conversation so far (one of
             4 shared system prompts, every earlier question and answer), --chat-out tokens a turn

vLLM serves the tasks as LoRAs through polyserve's resolver plugin (the same store and task ids),
in --vllm-dtype. Prints one JSON line per (server, workload) and a summary of ratios (of the
medians, where --servers names a server more than once: `polyserve,vllm,polyserve,vllm`).

    make vllm-env
    .venv/bin/python -m bench.prefix_bench --threads 2            # both servers
    .venv/bin/python -m bench.prefix_bench --servers polyserve --polyserve-env POLYSERVE_PREFIX_CACHE_TOKENS=0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx

from bench.vllm_client_bench import ROOT, start, stop

WORDS = ["cat", "dog", "tree", "river", "stone", "cloud", "apple", "seven", "blue", "quick", "lamp", "music",
         "paper", "garden", "window", "orange", "silver", "market", "engine", "rabbit", "ocean", "winter", "bridge",
         "candle", "forest"]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def completion_jobs(args: argparse.Namespace, tasks: list[str], shared: bool) -> list[dict]:
    rng = random.Random(args.seed)
    prefixes = {t: f"Context: {words(rng, args.prefix_words)}\n" for t in tasks}
    jobs = []
    for i in range(args.per_task):
        for t in tasks:
            prefix = prefixes[t] if shared else f"Context: {words(rng, args.prefix_words)}\n"
            jobs.append({"model": t, "prompt": f"{prefix}Input: {words(rng, args.question_words)}\nOutput:",
                         "max_tokens": args.out, "min_tokens": args.out, "ignore_eos": True, "temperature": 0,
                         "stream": True})
    return jobs


async def one(http: httpx.AsyncClient, path: str, body: dict) -> tuple[float, float, str]:
    """(TTFT, latency, text) of one streamed request."""
    t0 = time.perf_counter()
    first, text = None, []
    async with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path}: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{path}: {chunk['error']}")
            for c in chunk.get("choices", []):
                piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - t0
                text.append(piece)
    end = time.perf_counter() - t0
    return (end if first is None else first), end, "".join(text)


async def run_completions(url: str, jobs: list[dict], concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        async def go(body: dict) -> tuple[float, float, str]:
            async with sem:
                return await one(http, "/v1/completions", body)

        t0 = time.perf_counter()
        got = await asyncio.gather(*(go(b) for b in jobs))
        total = time.perf_counter() - t0
    ttft = [g[0] for g in got]
    return {"requests": len(jobs), "total_s": round(total, 2), "ttft_p50_s": round(statistics.median(ttft), 3),
            "output_tok_s": round(sum(b["max_tokens"] for b in jobs) / total, 1)}


async def run_chat(url: str, args: argparse.Namespace, model: str) -> dict:
    rng = random.Random(args.seed + 1)
    systems = [f"You are assistant number {i}. Notes: {words(rng, args.system_words)}" for i in range(4)]
    sem = asyncio.Semaphore(args.chat_concurrency)
    ttft: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        async def conversation(c: int) -> None:
            async with sem:
                messages = [{"role": "system", "content": systems[c % 4]}]
                for _ in range(args.turns):
                    messages.append({"role": "user", "content": f"Tell me about {words(rng, args.question_words)}."})
                    body = {"model": model, "messages": messages, "max_tokens": args.chat_out,
                            "min_tokens": args.chat_out, "ignore_eos": True, "temperature": 0, "stream": True}
                    first, _, text = await one(http, "/v1/chat/completions", body)
                    ttft.append(first)
                    messages.append({"role": "assistant", "content": text})

        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(c) for c in range(args.conversations)))
        total = time.perf_counter() - t0
    tokens = args.conversations * args.turns * args.chat_out
    return {"requests": args.conversations * args.turns, "total_s": round(total, 2),
            "ttft_p50_s": round(statistics.median(ttft), 3), "output_tok_s": round(tokens / total, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=None, help="store with the tasks (default: $POLYSERVE_HOME/store)")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--per-task", type=int, default=8)
    ap.add_argument("--prefix-words", type=int, default=400)
    ap.add_argument("--question-words", type=int, default=6)
    ap.add_argument("--out", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--chat-concurrency", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=100)
    ap.add_argument("--chat-out", type=int, default=32)
    ap.add_argument("--workloads", default="shared,unique,chat")
    ap.add_argument("--servers", default="polyserve,vllm")
    ap.add_argument("--polyserve-env", nargs="*", default=[], help="NAME=VALUE settings for polyserve's server")
    ap.add_argument("--threads", type=int, default=2, help="each server's compute threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--vllm-kv-gib", type=int, default=2)
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/prefix-bench"))
    args = ap.parse_args()
    # what bench.vllm_client_bench.start reads
    args.max_concurrency, args.vllm_args = args.concurrency, ["--enable-prefix-caching", "--max-model-len", "2048"]

    from adapters_store.backbone.home import polyserve_home
    from adapters_store.backbone.load import hf_dir
    from adapters_store.store.directory import DirectoryStore
    from training.shipped_inventory import install_default_inventory

    store = DirectoryStore(Path(args.store).expanduser() if args.store else polyserve_home() / "store")
    if not store.has_inventory():
        install_default_inventory(store)
    tasks = sorted(r.id for r in store.list_tasks() if r.status == "ready" and r.kind == "routing")[: args.tasks]
    model_dir = hf_dir("default")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    env = {"POLYSERVE_STORE": str(store.root), "POLYSERVE_MAX_PROMPT_TOKENS": "2048"}
    extra = dict(kv.split("=", 1) for kv in args.polyserve_env)
    results: dict[str, dict[str, list[dict]]] = {}
    for kind in args.servers.split(","):
        proc, handle, url = start(kind, args, args.out_dir, {**env, **(extra if kind == "polyserve" else {})},
                                  model_dir)
        try:
            for name in args.workloads.split(","):
                if name == "chat":
                    # vLLM serves the bare backbone under its path
                    row = asyncio.run(run_chat(url, args, "base" if kind == "polyserve" else str(model_dir)))
                else:
                    row = asyncio.run(run_completions(url, completion_jobs(args, tasks, name == "shared"),
                                                      args.concurrency))
                results.setdefault(kind, {}).setdefault(name, []).append(row)
                print(json.dumps({"server": kind, "workload": name, **row}), flush=True)
        finally:
            stop(proc, handle)
    print(json.dumps({"summary": summarise(results)}), flush=True)


def summarise(results: dict[str, dict[str, list[dict]]]) -> dict:
    """Ratios of the medians over the rounds (a server named twice in --servers ran twice)."""
    med = {kind: {name: {k: statistics.median(r[k] for r in runs) for k in ("total_s", "ttft_p50_s")}
                  for name, runs in rows.items()} for kind, rows in results.items()}
    summary: dict = {}
    for kind, rows in med.items():
        if "shared" in rows and "unique" in rows:
            summary[f"{kind}_unique_over_shared"] = round(rows["unique"]["total_s"] / rows["shared"]["total_s"], 2)
    if "polyserve" in med and "vllm" in med:
        p, v = med["polyserve"], med["vllm"]
        for name in p.keys() & v.keys():
            summary[f"{name}_speed_ratio"] = round(v[name]["total_s"] / p[name]["total_s"], 2)
            summary[f"{name}_ttft_p50_ratio"] = round(p[name]["ttft_p50_s"] / v[name]["ttft_p50_s"], 2)
    return summary


if __name__ == "__main__":
    main()
