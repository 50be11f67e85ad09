"""The native engine through the real server (HTTP) against the same engine driven in-process.

One closed-loop workload (each of --clients keeps one request in flight for --seconds: a random
shipped task, a random procedural input, greedy, --new-tokens at most, stopping at EOS): first on
a Runtime built in this process (no HTTP), then against `polyserve serve` in a subprocess over
HTTP (/v1/generate, httpx). Reports completion tokens/s and request latency p50/p99 of both and
the ratio: what the HTTP layer, the event loop and the server's threads cost (the server keeps one
OpenMP pool, the engine thread's: server/infra/openmp.py).

    .venv/bin/python -m bench.http_load --clients 16 --seconds 30 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import threading
import time
from pathlib import Path

import server  # noqa: F401  (before torch: OpenMP spin defaults, server/infra/openmp.py)
from server.infra import openmp

# isort: split
import httpx
import torch

from adapters_store.backbone.prompt import format_prompt
from bench.local_server import polyserve_server
from server.engines.request import GenRequest, SamplingParams
from server.infra.metrics import Metrics
from server.wiring.runtime import Runtime
from server.wiring.settings import Settings
from training.suite import build_suite, random_input


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def report(name: str, tokens: int, seconds: float, latencies: list[float]) -> float:
    rate = tokens / seconds
    print(f"{name:28s} {rate:7.1f} tok/s  {len(latencies):4d} requests  latency p50 {pct(latencies, 0.5):.2f}s "
          f"p99 {pct(latencies, 0.99):.2f}s", flush=True)
    return rate


def workload(seed: int) -> tuple[random.Random, list[str]]:
    tasks = [t.name for t in build_suite().train_tasks]
    return random.Random(seed), tasks


def in_process(args, home: Path) -> float:
    settings = Settings(home=home, store=home / "store", threads=args.threads, max_batch_rows=args.clients)
    rt = openmp.in_fresh_thread(Runtime.build, settings, Metrics())
    openmp.one_thread()
    try:
        tasks = [t for t in workload(0)[1] if rt.store.has_task(t)]
        tokens, latencies = [0] * args.clients, []
        stop = threading.Event()

        def client(i: int) -> None:
            rng = random.Random(i)
            while not stop.is_set():
                task = rng.choice(tasks)
                ids = rt.tokenizer(format_prompt(random_input(rng)), add_special_tokens=False).input_ids
                started = time.perf_counter()
                req = rt.engine.submit(GenRequest(list(ids), SamplingParams(max_new_tokens=args.new_tokens),
                                                  rt.registry.resolve(task), task))
                req.handle.wait()
                latencies.append(time.perf_counter() - started)
                tokens[i] += req.handle.events[-1].completion_tokens

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(args.seconds)
        stop.set()
        for t in threads:
            t.join()
        return report("in-process engine", sum(tokens), time.perf_counter() - started, latencies)
    finally:
        rt.close()


async def http_clients(args, url: str, tasks: list[str]) -> tuple[int, float, list[float]]:
    tokens, latencies = [0], []
    deadline = time.perf_counter() + args.seconds

    async def client(i: int, http: httpx.AsyncClient) -> None:
        rng = random.Random(i)
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            r = await http.post("/v1/generate", json={"task": rng.choice(tasks), "prompt": random_input(rng),
                                                      "max_new_tokens": args.new_tokens})
            r.raise_for_status()
            latencies.append(time.perf_counter() - started)
            tokens[0] += r.json()["usage"]["completion_tokens"]

    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        await asyncio.gather(*(client(i, http) for i in range(args.clients)))
    return tokens[0], time.perf_counter() - started, latencies


def over_http(args, home: Path) -> float:
    env = {"POLYSERVE_HOME": str(home), "POLYSERVE_STORE": str(home / "store"), "POLYSERVE_THREADS": str(args.threads),
           "POLYSERVE_MAX_BATCH_ROWS": str(args.clients)}
    with polyserve_server(env) as url:
        tasks = [t["id"] for t in httpx.get(url + "/v1/tasks").json()["data"] if t["status"] == "ready"]
        tasks = [t for t in workload(0)[1] if t in tasks]
        tokens, seconds, latencies = asyncio.run(http_clients(args, url, tasks))
    return report("polyserve serve over HTTP", tokens, seconds, latencies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    home = Path(tempfile.mkdtemp(prefix="polyserve-http-"))
    (home / "backbones").symlink_to(Path(os.environ.get("POLYSERVE_HOME", Path.home() / ".cache" / "polyserve"))
                                    / "backbones")  # the dequantised backbone, not rebuilt
    local = in_process(args, home)
    remote = over_http(args, home)
    print(f"HTTP / in-process: {remote / local:.2f}")


if __name__ == "__main__":
    main()
