"""One engine setting against another on the serving workload, turns interleaved, in one process
(or, with one value, that engine alone: run it in two checkouts, alternating, to compare code).

Drives NativeEngine.step() in this thread (no engine thread, no HTTP) over the routed workload
of bench/serve_bench.py, once per value of one engine setting per repeat, the values taking
turns, and reports each value's tokens a second and CPU seconds per 1,000 tokens (this thread's
CPU time: on one torch thread that is all of the step's work). The first run of each engine is
a warm-up (oneDNN builds its primitives per new shape) and is not timed.

    .venv/bin/python -m bench.engine_ab --field elementwise_kernel --values on off --threads 1
    .venv/bin/python -m bench.engine_ab --field attention_kernel --values on off --repeats 5
    .venv/bin/python -m bench.engine_ab --field lora_kernel --values auto --threads 1   # this checkout
    .venv/bin/python -m bench.engine_ab --field dtype --values float32 bfloat16 --threads 1
    .venv/bin/python -m bench.engine_ab --field weight_build --values native avx2 --threads 1
    .venv/bin/python -m bench.engine_ab --field prefix_cache_tokens --values 0 16384 --threads 2

`--field dtype` takes the serving dtypes as POLYSERVE_DTYPE spells them; the other settings stay
`auto`, so each dtype runs as the server would serve it (float32 on the GGUF blocks where the
weight kernel applies). `--field weight_build` takes builds of the weight kernel
(server/engines/native/kernels/quant_linear.py `BUILDS`): on an AVX-512 CPU serving float32 on the GGUF
blocks, its AVX-512 path against the AVX2 path that CPUs without AVX-512 run.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

from adapters_store.backbone.load import load_backbone
from bench.serve_bench import build_inventory, workload
from server.adapter_cache.cache import AdapterCache
from server.adapter_cache.l1 import L1Cache
from server.engines.dtype import serving_dtype
from server.engines.native.config import EngineConfig
from server.engines.native.core.engine import NativeEngine
from server.engines.native.kernels import quant_linear
from server.engines.native.tuning import Tuning
from server.engines.request import GenRequest, RequestHandle, SamplingParams


def routed_workload(backbone: str, tasks: int, requests: int, out_min: int, out_max: int, seed: int):
    """(backbone, routed model, task -> adapter, jobs): serve_bench's routed workload, its adapters materialised."""
    bb = load_backbone(backbone, dtype="float32")
    tmp = Path(tempfile.mkdtemp(prefix="polyserve-engine-ab-"))
    store, rm, _pm, names = build_inventory(bb, tasks, tmp / "store", seed)
    info, skills = store.load_inventory(bb.fingerprint)
    cache = AdapterCache(store, info, skills, fingerprint=bb.fingerprint, device=bb.device, dtype=torch.float32,
                         l1=L1Cache(4 << 30), routing_layers=False)
    adapters = {t: cache.get(store.get_task(t)) for t in names}
    return bb, rm, adapters, workload(requests, names, out_min, out_max, seed, "loguniform")


def run_once(engine: NativeEngine, tok, jobs, adapters) -> tuple[int, float, float]:
    """(tokens, wall s, this thread's CPU s) of serving every job to the end. Each run starts
    with an empty prefix cache: the same prompts again would be hits, not the workload."""
    if engine.prefix is not None:
        engine.prefix.clear()
    reqs = [engine.submit(GenRequest(tok(prompt, add_special_tokens=False).input_ids,
                                     SamplingParams(max_new_tokens=n, ignore_eos=True), adapters[task], task,
                                     handle=RequestHandle(None)))
            for task, prompt, n in jobs]
    wall, cpu = time.perf_counter(), time.thread_time()
    while engine.waiting or engine.running:
        engine.step()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    return sum(r.handle.events[-1].completion_tokens for r in reqs), wall, cpu


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--field", required=True,
                    help="a tuning switch set by a word (docs/tuning.md), e.g. elementwise_kernel; or dtype, "
                    "weight_build, prefix_cache_tokens")
    ap.add_argument("--values", nargs="+", required=True, help="its values, as the setting spells them")
    ap.add_argument("--backbone", default="default")
    ap.add_argument("--tasks", type=int, default=48)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out-min", type=int, default=4)
    ap.add_argument("--out-max", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="serving dtype (auto: as the server chooses; with "
                    "--field dtype, the values' instead)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    switches = {f.name for f in dataclasses.fields(Tuning) if isinstance(f.default, str)}
    fields = switches | {"dtype", "weight_build", "prefix_cache_tokens"}
    if args.field not in fields:
        raise SystemExit(f"--field must be a tuning switch set by a word, dtype, weight_build or "
                         f"prefix_cache_tokens: {', '.join(sorted(fields))}")
    if args.field == "weight_build" and not set(args.values) <= set(quant_linear.BUILDS):
        raise SystemExit(f"--field weight_build takes {', '.join(sorted(quant_linear.BUILDS))}")
    torch.set_num_threads(args.threads)

    dtype = serving_dtype("cpu", None if args.dtype == "auto" else args.dtype)
    bb, rm, adapters, jobs = routed_workload(args.backbone, args.tasks, args.requests, args.out_min, args.out_max,
                                             args.seed)
    engines = {}
    for value in args.values:
        setting = ({"dtype": serving_dtype("cpu", value)} if args.field == "dtype"
                   else {"dtype": dtype} if args.field == "weight_build"
                   else {"dtype": dtype, "tuning": Tuning(**{args.field: value})} if args.field in switches
                   else {"dtype": dtype, args.field: int(value) if value.isdigit() else value})
        cfg = EngineConfig(max_batch_rows=args.batch, max_batch_tokens=1 << 20, max_prefill_rows=args.batch,
                           max_queue=1 << 16, **setting)
        native = quant_linear.KERNEL
        if args.field == "weight_build":  # the runner's linears take the kernel's function when made
            quant_linear.KERNEL = quant_linear.BUILDS[value]
        try:
            engines[value] = NativeEngine(bb.model, bb.tokenizer, rm, cfg)
        finally:
            quant_linear.KERNEL = native
        runner = engines[value].runner
        print(f"{args.field}={value} runs in {str(runner.dtype).removeprefix('torch.')}, "
              f"{'on the GGUF blocks' if getattr(runner, 'weight_kernel', False) else 'on dense weights'}",
              flush=True)
        run_once(engines[value], bb.tokenizer, jobs, adapters)  # warm-up
    shown = "" if args.field == "dtype" else f"{dtype}, "
    print(f"{args.backbone}, {args.tasks} tasks, {args.requests} requests, batch {args.batch}, {shown}"
          f"{args.threads} torch threads; {args.field}: {' vs '.join(args.values)}", flush=True)
    results: dict[str, list[tuple[float, float]]] = {v: [] for v in args.values}
    for rep in range(args.repeats):
        for value, engine in engines.items():
            tokens, wall, cpu = run_once(engine, bb.tokenizer, jobs, adapters)
            results[value].append((tokens / wall, cpu / tokens * 1000))
            print(f"  repeat {rep} {args.field}={value}: {tokens} tokens, {tokens / wall:.1f} tok/s, "
                  f"{cpu / tokens * 1000:.2f} CPU s per 1,000 tokens", flush=True)
    ref = statistics.median(r[0] for r in results[args.values[0]])  # the first value's
    for value, rs in results.items():
        tps = statistics.median(r[0] for r in rs)
        cpu = statistics.median(r[1] for r in rs)
        print(f"{args.field}={value}: median {tps:.1f} tok/s (x{tps / ref:.3f} of {args.values[0]}), "
              f"{cpu:.2f} CPU s per 1,000 tokens")


if __name__ == "__main__":
    main()
