"""Where the native engine's time goes on the serving workload of bench/serve_bench.py.

Drives NativeEngine.step() in this thread (no engine thread, no HTTP) under cProfile and splits
the wall time of the whole run into buckets (the runner's forwards, of which the LoRA work,
adapter tables written at admission, slot moves, sampling, detokenisation + events, the rest);
then profiles `--op-steps` decode steps at full batch with torch.profiler and lists the top
operators. The same requests run once before without the profiler: that run's tok/s is the one
to compare.

    flock -x /tmp/polyserve-cpu.lock .venv/bin/python -m bench.profile_engine --threads 2
    .venv/bin/python -m bench.profile_engine --backbone tiny --requests 8   # a quick smoke run

Adapters on (routed rows of --tasks tasks) unless --base.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
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

# (bucket, file suffix, function name, nested): cumulative time of these functions; nested ones
# are inside an earlier bucket and not added to the total
BUCKETS = [
    ("forwards (runner)", "native/model/llama.py", "forward", False),
    ("  of which LoRA", "native/model/slot_lora.py", "apply", True),
    ("  of which attention", "native/model/attention.py", "slot_attention", True),
    ("step layout (StepBatch.build)", "native/core/step.py", "build", False),
    ("adapter tables (admission)", "native/model/slot_lora.py", "write_adapter", False),
    ("slot moves (rows leave)", "native/model/llama.py", "copy_slot", False),
    ("sampling", "native/sample/rows.py", "sample_rows", False),
    ("detokenise", "native/sample/detok.py", "add", False),
]


def cumulative(stats: pstats.Stats, suffix: str, name: str) -> float:
    total = 0.0
    for (path, _line, func), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if func == name and path.endswith(suffix):
            total += ct
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backbone", default="default")
    ap.add_argument("--tasks", type=int, default=48)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out-min", type=int, default=4)
    ap.add_argument("--out-max", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base", action="store_true", help="adapters off (every row is base)")
    ap.add_argument("--op-steps", type=int, default=20)
    ap.add_argument("--static-decode", choices=["auto", "on", "off"], default="auto",
                    help="the engine's POLYSERVE_STATIC_DECODE (CUDA graphs of decode steps; auto = on CUDA)")
    ap.add_argument("--packed-weights", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="serving dtype (auto: bfloat16 on CUDA and AMX CPUs)")
    ap.add_argument("--max-step-tokens", type=int, default=256)
    ap.add_argument("--top", type=int, default=0, help="also list the N functions of most own time (cProfile)")
    ap.add_argument("--cudnn-attention", action="store_true",
                    help="let dynamic steps use cuDNN's attention on CUDA (attention.cuda_backends leaves it out)")
    args = ap.parse_args()
    if args.cudnn_attention:
        from torch.nn.attention import SDPBackend

        from server.engines.native.model import attention
        attention.CUDA_BACKENDS.append(SDPBackend.CUDNN_ATTENTION)
    torch.set_num_threads(args.threads)

    dtype = serving_dtype(args.device, None if args.dtype == "auto" else args.dtype)
    bb = load_backbone(args.backbone, device=args.device, dtype="float32" if args.device == "cpu" else str(dtype)[6:])
    tmp = Path(tempfile.mkdtemp(prefix="polyserve-profile-"))
    store, rm, _pm, tasks = build_inventory(bb, args.tasks, tmp / "store", args.seed)
    info, skills = store.load_inventory(bb.fingerprint)
    cache = AdapterCache(store, info, skills, fingerprint=bb.fingerprint, device=bb.device,
                         dtype=next(bb.model.parameters()).dtype, l1=L1Cache(4 << 30), routing_layers=False)
    adapters = {t: cache.get(store.get_task(t)) for t in tasks}
    engine = NativeEngine(bb.model, bb.tokenizer, rm, EngineConfig(
        max_batch_rows=args.batch, max_batch_tokens=1 << 20, max_prefill_rows=args.batch, max_queue=1 << 16,
        max_step_tokens=args.max_step_tokens, dtype=dtype,
        tuning=Tuning(packed_weights=args.packed_weights, static_decode=args.static_decode)))
    tok = bb.tokenizer

    def submit_all(jobs) -> list[GenRequest]:
        reqs = []
        for task, prompt, n in jobs:
            req = GenRequest(tok(prompt, add_special_tokens=False).input_ids,
                             SamplingParams(max_new_tokens=n, ignore_eos=True),
                             None if args.base else adapters[task], task, handle=RequestHandle(None))
            reqs.append(engine.submit(req))
        return reqs

    jobs = workload(args.requests, tasks, args.out_min, args.out_max, args.seed, "loguniform")
    submit_all(jobs[:4])
    while engine.waiting or engine.running:
        engine.step()  # warm-up

    reqs = submit_all(jobs)
    started = time.perf_counter()
    while engine.waiting or engine.running:
        engine.step()
    wall = time.perf_counter() - started
    tokens = sum(r.handle.events[-1].completion_tokens for r in reqs)
    print(f"no profiler: {tokens} tokens in {wall:.1f} s = {tokens / wall:.1f} tok/s")

    reqs = submit_all(jobs)
    prof = cProfile.Profile()
    started = time.perf_counter()
    prof.enable()
    while engine.waiting or engine.running:
        engine.step()
    prof.disable()
    wall = time.perf_counter() - started
    tokens = sum(r.handle.events[-1].completion_tokens for r in reqs)
    stats = pstats.Stats(prof)
    ex = engine.runner
    print(f"{args.backbone}, {'base' if args.base else f'{args.tasks} tasks'}, {args.requests} requests, "
          f"{ex.name} runner, {ex.dtype}, packed {getattr(ex, 'packed', False)}, {args.max_step_tokens} tokens a step, "
          f"{args.batch} rows, {args.threads} threads: {tokens} tokens in {wall:.1f} s = {tokens / wall:.1f} tok/s "
          f"(under cProfile), {engine.steps} steps")
    rows = [(label, cumulative(stats, suffix, name), nested) for label, suffix, name, nested in BUCKETS]
    print(f"{'bucket':32s} {'seconds':>8s} {'share':>6s}")
    for label, t, _ in rows:
        print(f"{label:32s} {t:8.2f} {100 * t / wall:5.1f}%")
    counted = sum(t for _, t, nested in rows if not nested)
    print(f"{'everything else':32s} {wall - counted:8.2f} {100 * (wall - counted) / wall:5.1f}%")
    if args.top:
        stats.sort_stats("tottime").print_stats(args.top)

    # operator view of full-batch decode steps
    submit_all([(t, p, 10_000) for t, p, _ in jobs[: args.batch]])
    while engine.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    from torch.profiler import ProfilerActivity, profile

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    started = time.perf_counter()
    for _ in range(args.op_steps):
        engine.step()
    sync()
    print(f"\n{len(engine.rows)}-row decode steps: {1000 * (time.perf_counter() - started) / args.op_steps:.2f} ms "
          f"each (wall, {args.op_steps} steps, no profiler)")
    # CUPTI (the profiler's CUDA activity) over CUDA graph replays is a known crash in PyTorch (an
    # illegal memory access): with graphs on, the operators are profiled on the CPU side only
    graphs = cuda and getattr(engine.runner, "static", None) is not None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda and not graphs else [])
    with profile(activities=activities) as p:
        for _ in range(args.op_steps):
            engine.step()
    print(f"\ntop operators over {args.op_steps} decode steps of {len(engine.rows)} rows "
          f"(self CPU time):")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
    if cuda and not graphs:
        events = p.key_averages()
        gpu = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e6
        launches = sum(e.count for e in events if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel")))
        print(f"GPU busy {gpu:.3f} s over {args.op_steps} steps; kernel launches per step: "
              f"{launches / args.op_steps:.0f}")


if __name__ == "__main__":
    main()
