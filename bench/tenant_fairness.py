"""Two tenants through the real server (HTTP): fair admission against first come, first served.

Tenant `flood` keeps --flood-connections connections busy with long requests (n=4, --flood-tokens
each); tenant `small` sends short requests (--small-tokens) one after another. Each round starts
a fresh `polyserve serve` per variant, alternating (fcfs, fair, fcfs, fair, ...), on the same
settings except POLYSERVE_TENANT_FAIRNESS (fair admission lends every row and takes rows back by
preemption, so no static per-tenant row cap is set unless --tenant-rows asks for one):

    idle    `small` alone: its latency p50 / p95 (the reference)
    mixed   `flood` and `small` together for --seconds: small's status codes and latency p50 / p95
            (requests still running at the end are waited for), and the throughput of the whole
            server: generated tokens per second over the window, read from the server's own
            polyserve_generation_tokens_total (both tenants, finished or not)

    flock /tmp/bench.lock .venv/bin/python -m bench.tenant_fairness --backbone tiny --rounds 2 --seconds 60 --idle-seconds 15
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time

import httpx

from bench.local_server import polyserve_server

KEYS = {"flood": "flood-key", "small": "small-key"}
FLOOD_PROMPT = "Write a long, detailed story about a lighthouse keeper and the sea, chapter by chapter."
SMALL_PROMPT = "The capital of France is"


def p95(xs: list[float]) -> float:
    return sorted(xs)[max(0, round(0.95 * len(xs)) - 1)] if xs else float("nan")


def generated_tokens(client: httpx.Client) -> float:
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("polyserve_generation_tokens_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def small_client(url: str, tokens: int, until: float, out: list[tuple[int, float]]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=900,
                                 headers={"Authorization": f"Bearer {KEYS['small']}"}) as c:
        while time.monotonic() < until:
            t0 = time.monotonic()
            r = await c.post("/v1/completions", json={"model": "base", "prompt": SMALL_PROMPT, "max_tokens": tokens,
                                                      "temperature": 0})
            out.append((r.status_code, time.monotonic() - t0))


async def flood_client(url: str, tokens: int, until: float, statuses: list[int]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=900,
                                 headers={"Authorization": f"Bearer {KEYS['flood']}"}) as c:
        while time.monotonic() < until:
            try:
                r = await c.post("/v1/completions", json={"model": "base", "prompt": FLOOD_PROMPT, "n": 4,
                                                          "max_tokens": tokens, "temperature": 0})
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
        floods = [asyncio.create_task(flood_client(url, args.flood_tokens, until, flood))
                  for _ in range(args.flood_connections)]
        await asyncio.sleep(args.warm_seconds)  # the flood fills the engine first
        await small_client(url, args.small_tokens, until, small)
        after, t1 = generated_tokens(c), time.monotonic()  # the window's throughput, before the drain
        for f in floods:
            f.cancel()
    latencies = [s for _, s in small]
    return {"small_status": sorted({code for code, _ in small}), "small_n": len(small),
            "small_p50": statistics.median(latencies), "small_p95": p95(latencies),
            "tokens_per_s": (after - before) / (t1 - t0), "flood_status": sorted(set(flood))}


async def idle(url: str, args: argparse.Namespace) -> dict:
    small: list[tuple[int, float]] = []
    await small_client(url, args.small_tokens, time.monotonic() + args.idle_seconds, small)
    latencies = [s for _, s in small]
    return {"idle_n": len(small), "idle_p50": statistics.median(latencies), "idle_p95": p95(latencies)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=60.0, help="mixed phase")
    ap.add_argument("--warm-seconds", type=float, default=5.0, help="flood alone before small starts")
    ap.add_argument("--idle-seconds", type=float, default=15.0)
    ap.add_argument("--flood-connections", type=int, default=24)
    ap.add_argument("--flood-tokens", type=int, default=384)
    ap.add_argument("--small-tokens", type=int, default=16)
    ap.add_argument("--rows", type=int, default=32, help="POLYSERVE_MAX_BATCH_ROWS")
    ap.add_argument("--tenant-rows", type=int, default=None, help="POLYSERVE_TENANT_MAX_ROWS (fair variant; "
                    "default none: rows are lent and taken back by preemption)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--backbone", default="default", help="default | tiny (a random tiny Llama: the scheduler "
                    "under a fast step) | a Hugging Face directory; served as `base` from an empty store")
    args = ap.parse_args()
    store = tempfile.mkdtemp(prefix="tenant-fairness-")
    base = {"POLYSERVE_API_KEYS": ",".join(f"{n}:{k}" for n, k in KEYS.items()), "POLYSERVE_STORE": store,
            "POLYSERVE_BACKBONE": args.backbone,
            "POLYSERVE_MAX_BATCH_ROWS": str(args.rows), "POLYSERVE_MAX_QUEUE": "256"}
    if args.threads:
        base["POLYSERVE_THREADS"] = str(args.threads)
    variants = {"fcfs": {"POLYSERVE_TENANT_FAIRNESS": "false"},
                "fair": {"POLYSERVE_TENANT_FAIRNESS": "true"}}
    if args.tenant_rows:
        variants["fair"]["POLYSERVE_TENANT_MAX_ROWS"] = str(args.tenant_rows)
    results: dict[str, list[dict]] = {k: [] for k in variants}
    for rnd in range(args.rounds):
        for name, env in variants.items():
            with polyserve_server({**base, **env}) as url:
                row = {**asyncio.run(idle(url, args)), **asyncio.run(mixed(url, args))}
            row["p95_over_idle"] = row["small_p95"] / row["idle_p95"]
            results[name].append(row)
            print(json.dumps({"round": rnd, "variant": name, **{k: (round(v, 3) if isinstance(v, float) else v)
                                                                 for k, v in row.items()}}), flush=True)
    fair_tps = statistics.mean(r["tokens_per_s"] for r in results["fair"])
    fcfs_tps = statistics.mean(r["tokens_per_s"] for r in results["fcfs"])
    print(json.dumps({"args": vars(args)}))
    print(json.dumps({"throughput_fair_over_fcfs": round(fair_tps / fcfs_tps, 3),
                      "small_p95_over_idle": {k: [round(r["p95_over_idle"], 2) for r in v] for k, v in results.items()}}))


if __name__ == "__main__":
    main()
