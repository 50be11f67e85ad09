"""Where a routed run's extra time goes, against adapters off: the native engine driven in this
thread on bench/serve_bench.py's workload, wall time split into forwards of decode-only steps,
forwards of steps that carry prompt chunks, adapter tables written at admission (`set_adapter`),
slot moves (`copy_slot`) and the rest of the loop. Modes run interleaved in one process:

    a  routed rows, the LoRA in the native kernel (the default)
    t  routed rows, the LoRA as torch ops (POLYSERVE_LORA_KERNEL=off)
    b  adapters off

    .venv/bin/python -m bench.step_split --modes atbatb --dtype bfloat16
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import server  # noqa: F401  (before torch: OpenMP spin defaults, server/infra/openmp.py)

# isort: split
import torch

from adapters_store.backbone.load import load_backbone
from bench.serve_bench import build_inventory, workload
from server.adapter_cache.cache import AdapterCache
from server.adapter_cache.l1 import L1Cache
from server.engines.dtype import serving_dtype
from server.engines.native.config import EngineConfig
from server.engines.native.core.engine import NativeEngine
from server.engines.native.tuning import Tuning
from server.engines.request import GenRequest, RequestHandle, SamplingParams


def timed(stats: dict, key: str, fn):
    def run(*args):
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            stats[key] = stats.get(key, 0.0) + time.perf_counter() - started
    return run


def run_mode(engine: NativeEngine, jobs, adapters, tokenizer, base: bool) -> dict:
    ex = engine.runner
    stats: dict = {}
    forward = ex.forward

    def split_forward(batch):
        kind = "chunk steps" if batch.chunks else "decode steps"
        stats["n " + kind] = stats.get("n " + kind, 0) + 1
        return timed(stats, kind, forward)(batch)

    ex.forward = split_forward
    ex.set_adapter = timed(stats, "set_adapter", type(ex).set_adapter.__get__(ex))
    ex.copy_slot = timed(stats, "copy_slot", type(ex).copy_slot.__get__(ex))
    try:
        reqs = [engine.submit(GenRequest(tokenizer(p, add_special_tokens=False).input_ids,
                                         SamplingParams(max_new_tokens=n, ignore_eos=True),
                                         None if base else adapters[task], task, handle=RequestHandle(None)))
                for task, p, n in jobs]
        started = time.perf_counter()
        while engine.waiting or engine.running:
            engine.step()
        stats["wall"] = time.perf_counter() - started
    finally:
        del ex.forward, ex.set_adapter, ex.copy_slot
    stats["tok/s"] = sum(r.handle.events[-1].completion_tokens for r in reqs) / stats["wall"]
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="atbatb")
    ap.add_argument("--tasks", type=int, default=48)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    if set(args.modes) - set("atb"):
        raise SystemExit("--modes takes the letters a, t, b")
    torch.set_num_threads(args.threads)
    dtype = serving_dtype("cpu", None if args.dtype == "auto" else args.dtype)
    bb = load_backbone("default", device="cpu", dtype="float32")
    root = Path(tempfile.mkdtemp(prefix="polyserve-split-")) / "store"
    store, rm, _pm, tasks = build_inventory(bb, args.tasks, root, 0)
    info, skills = store.load_inventory(bb.fingerprint)
    cache = AdapterCache(store, info, skills, fingerprint=bb.fingerprint, device=bb.device, dtype=torch.float32,
                         l1=L1Cache(4 << 30), routing_layers=False)
    adapters = {t: cache.get(store.get_task(t)) for t in tasks}
    jobs = workload(args.requests, tasks, 4, 256, 0, "loguniform")
    engines = {m: NativeEngine(bb.model, bb.tokenizer, rm,
                               EngineConfig(max_batch_rows=args.batch, max_batch_tokens=1 << 20,
                                            max_prefill_rows=args.batch, max_queue=1 << 16, dtype=dtype,
                                            tuning=Tuning(lora_kernel="off" if m == "t" else "auto")))
               for m in sorted(set(args.modes))}
    for m, eng in engines.items():  # warm-up
        run_mode(eng, jobs[:4], adapters, bb.tokenizer, m == "b")
    print(f"{dtype}, {args.threads} threads, {args.requests} requests of {args.tasks} tasks; seconds")
    keys = ["decode steps", "chunk steps", "set_adapter", "copy_slot"]
    print(f"mode {'tok/s':>7s} {'wall':>6s} " + " ".join(f"{k:>12s}" for k in keys) + f" {'rest':>6s}")
    for m in args.modes:
        s = run_mode(engines[m], jobs, adapters, bb.tokenizer, m == "b")
        rest = s["wall"] - sum(s.get(k, 0.0) for k in keys)
        print(f"{m:4s} {s['tok/s']:7.1f} {s['wall']:6.2f} " + " ".join(f"{s.get(k, 0.0):12.2f}" for k in keys)
              + f" {rest:6.2f}  ({s.get('n decode steps', 0)} decode, {s.get('n chunk steps', 0)} chunk steps)",
              flush=True)


if __name__ == "__main__":
    main()
