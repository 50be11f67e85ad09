"""What per-request mixes and structured rows cost, side by side in one run on the native engine
(default backbone, shipped inventory):

    (t) single tasks     every request runs one shipped task
    (m) mixes            the same requests, each task replaced by a 2-task mix (it and another)
    (u) unconstrained    the same requests, all plain text (= (t))
    (s) half structured  the same requests, every other one with a json_schema response_format

Variants alternate (--rounds), one engine serves them all. Output lengths are fixed (EOS ignored)
except for constrained rows, which end when their JSON is complete: (s) reports tokens/s over all
rows and the inter-token latency (ITL) of its unconstrained and constrained rows apart.
Then the admission-time pieces alone, alternating per request: resolving the adapter (L1 hit;
a mix's first resolve combines its members' rows) and writing a row's tables (set_adapter).

    .venv/bin/python -m bench.mix_structured --requests 32 --rounds 2 --threads 1
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import server  # noqa: F401  (before torch: OpenMP spin defaults, server/infra/openmp.py)
from server.infra import openmp

# isort: split
import torch

from adapters_store.backbone.load import load_backbone
from adapters_store.lora.inject import RoutedModel
from adapters_store.lora.mix import parse_mix
from adapters_store.store.directory import DirectoryStore
from bench.serve_bench import TimedHandle, pct, workload
from server.adapter_cache.cache import AdapterCache
from server.adapter_cache.l1 import L1Cache
from server.engines.native.config import EngineConfig
from server.engines.native.core.engine import NativeEngine
from server.engines.request import FinalEvent, GenRequest, SamplingParams
from training.shipped_inventory import install_default_inventory

SCHEMA = {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                     "maxItems": 6}}, "required": ["words"]}
FORMAT = ("json_schema", json.dumps(SCHEMA))


def setup(threads: int):
    torch.set_num_threads(threads)
    bb = load_backbone("default", device="cpu", dtype="float32")
    store = DirectoryStore(Path(tempfile.mkdtemp(prefix="polyserve-mixbench-")) / "store")
    install_default_inventory(store)
    info, skills = store.load_inventory(bb.fingerprint)
    routed = RoutedModel(bb.model, info.spec)
    routed.load_skills(skills)
    cache = AdapterCache(store, info, skills, fingerprint=bb.fingerprint, device=bb.device,
                         dtype=next(bb.model.parameters()).dtype, l1=L1Cache(1 << 30), routing_layers=False)
    return bb, store, routed, cache


def run(engine, tok, jobs, adapters, formats) -> dict:
    t0 = time.perf_counter()
    reqs = []
    for (task, prompt, n), fmt in zip(jobs, formats, strict=True):
        params = SamplingParams(max_new_tokens=n, ignore_eos=fmt is None, response_format=fmt)
        req = GenRequest(tok(prompt, add_special_tokens=False).input_ids, params, adapters[task], task,
                         handle=TimedHandle())
        req.arrival = t0
        reqs.append(engine.submit(req))
    for req in reqs:
        req.handle.wait()
    wall = time.perf_counter() - t0
    tokens, itl_plain, itl_json, ttft = 0, [], [], []
    for req, fmt in zip(reqs, formats, strict=True):
        final = req.handle.events[-1]
        assert isinstance(final, FinalEvent) and final.error is None, final
        tokens += final.completion_tokens
        times = req.handle.times
        ttft.append(times[0] - t0)
        (itl_plain if fmt is None else itl_json).extend(b - a for a, b in itertools.pairwise(times))
    return {"wall": wall, "tokens": tokens, "tok_s": tokens / wall, "ttft_p50": pct(ttft, 0.5),
            "itl_plain_p50": pct(itl_plain, 0.5), "itl_json_p50": pct(itl_json, 0.5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out-min", type=int, default=16)
    ap.add_argument("--out-max", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    bb, store, routed, cache = openmp.in_fresh_thread(setup, args.threads)
    openmp.one_thread()
    tasks = sorted(r.id for r in store.list_tasks() if r.kind == "routing")
    jobs = workload(args.requests, tasks, args.out_min, args.out_max, seed=0)
    mix_of = {t: f"mix:{t}=0.6,{tasks[(i + 1) % len(tasks)]}=0.4" for i, t in enumerate(tasks)}
    mix_jobs = [(mix_of[t], p, n) for t, p, n in jobs]
    adapters = {t: cache.get(store.get_task(t)) for t, _, _ in jobs}

    def resolve_mix(mix: str):
        m = parse_mix(mix)
        return cache.get_mix(m, [store.get_task(t) for t in m.tasks])

    adapters.update({m: resolve_mix(m) for m, _, _ in mix_jobs})
    plain = [None] * len(jobs)
    half = [FORMAT if i % 2 else None for i in range(len(jobs))]

    def start() -> NativeEngine:
        eng = NativeEngine(bb.model, bb.tokenizer, routed, EngineConfig(
            max_batch_rows=args.batch, max_batch_tokens=1 << 20, max_prefill_rows=args.batch, max_queue=1 << 16,
            threads=args.threads))
        eng.start()
        return eng

    engine = openmp.in_fresh_thread(start)
    results: dict[str, list[dict]] = {"t": [], "m": [], "u": [], "s": []}
    try:
        run(engine, bb.tokenizer, jobs[:4], adapters, half[:4])  # warm-up (and the grammar's tokenizer view)
        for _ in range(args.rounds):
            results["t"].append(run(engine, bb.tokenizer, jobs, adapters, plain))
            results["m"].append(run(engine, bb.tokenizer, mix_jobs, adapters, plain))
            results["u"].append(run(engine, bb.tokenizer, jobs, adapters, plain))
            results["s"].append(run(engine, bb.tokenizer, jobs, adapters, half))
        write = admission(engine, store, cache, tasks, mix_of)
    finally:
        engine.stop()
    names = {"t": "(t) single tasks", "m": "(m) 2-task mixes", "u": "(u) all unconstrained",
             "s": "(s) every other row json_schema"}
    print(f"default backbone, float32, {args.threads} thread(s), {args.requests} requests, batch {args.batch}, "
          f"{args.rounds} rounds (means)")
    print(f"{'variant':34} {'tokens':>7} {'tok/s':>7} {'TTFT p50':>9} {'ITL p50 plain':>14} {'ITL p50 json':>13}")
    for key, runs in results.items():
        mean = {k: statistics.fmean(r[k] for r in runs) for k in runs[0]}
        json_itl = f"{mean['itl_json_p50'] * 1e3:10.1f} ms" if key == "s" else f"{'-':>13}"
        print(f"{names[key]:34} {mean['tokens']:7.0f} {mean['tok_s']:7.1f} {mean['ttft_p50'] * 1e3:6.0f} ms "
              f"{mean['itl_plain_p50'] * 1e3:11.1f} ms {json_itl}")
    for line in write:
        print(line)


def admission(engine: NativeEngine, store: DirectoryStore, cache: AdapterCache, tasks: list[str],
              mix_of: dict) -> list[str]:
    """Per request, alternating task / mix: the adapter's resolve (L1 hit) and the row's table write."""
    resolve_t, resolve_m, write_t, write_m = [], [], [], []
    records = {t: store.get_task(t) for t in tasks}

    def one() -> None:
        for task in tasks[:64]:
            t = time.perf_counter()
            single = cache.get(records[task])
            resolve_t.append(time.perf_counter() - t)
            m = parse_mix(mix_of[task])
            cache.get_mix(m, [records[x] for x in m.tasks])  # resolved once before (as a served mix is)
            t = time.perf_counter()
            mixed = cache.get_mix(m, [records[x] for x in m.tasks])
            resolve_m.append(time.perf_counter() - t)
            with torch.inference_mode():
                t = time.perf_counter()
                engine.runner.set_adapter(0, single)
                write_t.append(time.perf_counter() - t)
                t = time.perf_counter()
                engine.runner.set_adapter(0, mixed)
                write_m.append(time.perf_counter() - t)

    openmp.in_fresh_thread(one)
    m = parse_mix(f"mix:{tasks[0]}=0.3,{tasks[1]}=0.3,{tasks[2]}=0.4")
    t = time.perf_counter()
    cache.get_mix(m, [records[x] for x in m.tasks])  # a mix never resolved: combines its members' rows
    first = time.perf_counter() - t
    ms = 1e3
    return [(f"admission, {len(write_t)} requests each: resolve (L1 hit) task {pct(resolve_t, 0.5) * ms:.3f} ms, "
            f"mix {pct(resolve_m, 0.5) * ms:.3f} ms (p50); "
            f"write the row's tables task {pct(write_t, 0.5) * ms:.2f} ms, "
            f"mix {pct(write_m, 0.5) * ms:.2f} ms (p50)"),
            f"a 3-task mix's first resolve (members in L1, rows combined): {first * ms:.2f} ms"]


if __name__ == "__main__":
    main()
