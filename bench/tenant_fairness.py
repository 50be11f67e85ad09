"""Two tenants through the real server (HTTP): fair admission against first come, first served.

Tenant `flood` keeps --flood-connections connections busy with long requests (n=4, --flood-tokens
each); tenant `small` sends short requests (--small-tokens). Two floods (--flood):

    short   the flood's prompt is one sentence, greedy; small sends one request after another
    long    the flood's prompts are --prompt-words words each (different for every request),
            temperature 0.8: its prompt chunks fill the engine's steps; small starts a request
            every --small-every seconds (whether the last one ended or not)

Each round starts a fresh `polyserve serve` per variant, alternating, on the same settings except:

    fcfs       POLYSERVE_TENANT_FAIRNESS=false (one first-come-first-served queue)
    fair       fair admission (rows lent, taken back by preemption; no static per-tenant row cap
               unless --tenant-rows asks for one), with POLYSERVE_TENANT_PREFILL_TOKENS set to
               --prefill-tokens (default: the server's, 32)
    unbounded  fair admission with POLYSERVE_TENANT_PREFILL_TOKENS=0

    idle    `small` alone: its latency p50 / p95 (the reference)
    mixed   `flood` and `small` together for --seconds: small's status codes and latency p50 / p95
            (requests still running at the end are waited for), and the throughput of the whole
            server: generated tokens per second over the window, read from the server's own
            polyserve_generation_tokens_total (both tenants, finished or not)

    flock /tmp/bench.lock .venv/bin/python -m bench.tenant_fairness --backbone tiny --rounds 2 \
        --seconds 60 --idle-seconds 15
    flock /tmp/bench.lock .venv/bin/python -m bench.tenant_fairness --flood long --rounds 1 \
        --variants unbounded,fair,fcfs --prefill-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time

import httpx

from bench.local_server import polyserve_server

KEYS = {"flood": "flood-key", "small": "small-key"}
FLOOD_PROMPT = "Write a long, detailed story about a lighthouse keeper and the sea, chapter by chapter."
SMALL_PROMPT = "The capital of France is"


def long_prompt(rng: random.Random, words: int) -> str:
    """`words` words of plain English, different for every call."""
    vocab = ["the", "sea", "keeper", "light", "storm", "night", "ship", "rock", "wave", "tower", "lamp", "wind",
             "harbour", "sailor", "rope", "bell", "cliff", "fog", "gull", "tide", "boat", "salt", "shore", "coast",
             "island", "oil", "glass", "stair", "door", "window", "cold", "morning", "evening", "letter", "winter",
             "summer", "village", "captain", "anchor", "compass", "map", "river", "bridge", "road"]
    return "Continue this story. " + " ".join(rng.choice(vocab) for _ in range(words))


def p95(xs: list[float]) -> float:
    return sorted(xs)[max(0, round(0.95 * len(xs)) - 1)] if xs else float("nan")


def generated_tokens(client: httpx.Client) -> float:
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("polyserve_generation_tokens_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def small_client(url: str, tokens: int, until: float, out: list[tuple[int, float]],
                       every: float | None = None) -> None:
    """One request after another, or (`every`) one started every `every` seconds."""
    async with httpx.AsyncClient(base_url=url, timeout=900,
                                 headers={"Authorization": f"Bearer {KEYS['small']}"}) as c:
        async def one() -> None:
            t0 = time.monotonic()
            r = await c.post("/v1/completions", json={"model": "base", "prompt": SMALL_PROMPT, "max_tokens": tokens,
                                                      "temperature": 0})
            out.append((r.status_code, time.monotonic() - t0))

        if every is None:
            while time.monotonic() < until:
                await one()
            return
        started = []
        while time.monotonic() < until:
            started.append(asyncio.create_task(one()))
            await asyncio.sleep(every)
        await asyncio.gather(*started)


async def flood_client(url: str, args: argparse.Namespace, until: float, statuses: list[int], seed: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=900,
                                 headers={"Authorization": f"Bearer {KEYS['flood']}"}) as c:
        while time.monotonic() < until:
            long = args.flood == "long"
            body = {"model": "base", "prompt": long_prompt(rng, args.prompt_words) if long else FLOOD_PROMPT,
                    "n": 4, "max_tokens": args.flood_tokens, "temperature": 0.8 if long else 0}
            try:
                r = await c.post("/v1/completions", json=body)
                statuses.append(r.status_code)
                if r.status_code == 429:
                    await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
            except httpx.HTTPError:
                statuses.append(0)


async def mixed(url: str, args: argparse.Namespace) -> dict:
    small: list[tuple[int, float]] = []
    flood: list[int] = []
    with httpx.Client(base_url=url, timeout=30) as c:
        before, t0 = generated_tokens(c), time.monotonic()
        until = t0 + args.seconds
        floods = [asyncio.create_task(flood_client(url, args, until, flood, seed=i))
                  for i in range(args.flood_connections)]
        await asyncio.sleep(args.warm_seconds)  # the flood fills the engine first
        await small_client(url, args.small_tokens, until, small, args.small_every)
        after, t1 = generated_tokens(c), time.monotonic()  # the window's throughput, before the drain
        for f in floods:
            f.cancel()
    latencies = [s for _, s in small]
    return {"small_status": sorted({code for code, _ in small}), "small_n": len(small),
            "small_p50": statistics.median(latencies), "small_p95": p95(latencies),
            "tokens_per_s": (after - before) / (t1 - t0), "flood_status": sorted(set(flood))}


async def idle(url: str, args: argparse.Namespace) -> dict:
    # a fresh server's first requests pay one-time costs (first shapes, allocations): not the reference
    await small_client(url, args.small_tokens, time.monotonic() + args.idle_warm_seconds, [], args.small_every)
    small: list[tuple[int, float]] = []
    await small_client(url, args.small_tokens, time.monotonic() + args.idle_seconds, small, args.small_every)
    latencies = [s for _, s in small]
    return {"idle_n": len(small), "idle_p50": statistics.median(latencies), "idle_p95": p95(latencies)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flood", choices=("short", "long"), default="short")
    ap.add_argument("--variants", default="fcfs,fair", help="comma-separated: fcfs, fair, unbounded")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=None, help="mixed phase (default: short 60, long 75)")
    ap.add_argument("--warm-seconds", type=float, default=5.0, help="flood alone before small starts")
    ap.add_argument("--idle-seconds", type=float, default=15.0)
    ap.add_argument("--idle-warm-seconds", type=float, default=3.0, help="small alone, not counted, before idle")
    ap.add_argument("--flood-connections", type=int, default=24)
    ap.add_argument("--flood-tokens", type=int, default=384)
    ap.add_argument("--prompt-words", type=int, default=400, help="long flood: words per prompt")
    ap.add_argument("--small-tokens", type=int, default=None, help="default: short 16, long 8")
    ap.add_argument("--small-every", type=float, default=None, help="seconds between small requests "
                    "(default: short none = one after another, long 0.3)")
    ap.add_argument("--rows", type=int, default=32, help="POLYSERVE_MAX_BATCH_ROWS")
    ap.add_argument("--tenant-rows", type=int, default=None, help="POLYSERVE_TENANT_MAX_ROWS (fair variant; "
                    "default none: rows are lent and taken back by preemption)")
    ap.add_argument("--prefill-tokens", type=int, default=None, help="POLYSERVE_TENANT_PREFILL_TOKENS of the fair "
                    "variant (default: the server's)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--backbone", default="default", help="default | tiny (a random tiny Llama: the scheduler "
                    "under a fast step) | a Hugging Face directory; served as `base` from an empty store")
    args = ap.parse_args()
    long = args.flood == "long"
    args.seconds = args.seconds if args.seconds is not None else 75.0 if long else 60.0
    args.small_tokens = args.small_tokens if args.small_tokens is not None else 8 if long else 16
    args.small_every = args.small_every if args.small_every is not None else 0.3 if long else None
    store = tempfile.mkdtemp(prefix="tenant-fairness-")
    base = {"POLYSERVE_API_KEYS": ",".join(f"{n}:{k}" for n, k in KEYS.items()), "POLYSERVE_STORE": store,
            "POLYSERVE_BACKBONE": args.backbone,
            "POLYSERVE_MAX_BATCH_ROWS": str(args.rows), "POLYSERVE_MAX_QUEUE": "256"}
    if args.threads:
        base["POLYSERVE_THREADS"] = str(args.threads)
    known = {"fcfs": {"POLYSERVE_TENANT_FAIRNESS": "false"},
             "fair": {"POLYSERVE_TENANT_FAIRNESS": "true"},
             "unbounded": {"POLYSERVE_TENANT_FAIRNESS": "true", "POLYSERVE_TENANT_PREFILL_TOKENS": "0"}}
    variants = {name: dict(known[name]) for name in args.variants.split(",")}
    if args.prefill_tokens is not None and "fair" in variants:
        variants["fair"]["POLYSERVE_TENANT_PREFILL_TOKENS"] = str(args.prefill_tokens)
    for name in ("fair", "unbounded"):
        if args.tenant_rows and name in variants:
            variants[name]["POLYSERVE_TENANT_MAX_ROWS"] = str(args.tenant_rows)
    results: dict[str, list[dict]] = {k: [] for k in variants}
    for rnd in range(args.rounds):
        for name, env in variants.items():
            with polyserve_server({**base, **env}) as url:
                row = {**asyncio.run(idle(url, args)), **asyncio.run(mixed(url, args))}
            row["p95_over_idle"] = row["small_p95"] / row["idle_p95"]
            results[name].append(row)
            print(json.dumps({"round": rnd, "variant": name, **{k: (round(v, 3) if isinstance(v, float) else v)
                                                                 for k, v in row.items()}}), flush=True)
    tps = {k: statistics.mean(r["tokens_per_s"] for r in v) for k, v in results.items()}
    print(json.dumps({"args": vars(args)}))
    summary: dict = {"small_p95_over_idle": {k: [round(r["p95_over_idle"], 2) for r in v] for k, v in results.items()}}
    for a, b in (("fair", "fcfs"), ("fair", "unbounded"), ("unbounded", "fcfs")):
        if a in tps and b in tps:
            summary[f"throughput_{a}_over_{b}"] = round(tps[a] / tps[b], 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
