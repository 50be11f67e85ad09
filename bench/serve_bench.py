"""Serving benchmark: a mixed-task workload run side by side in ONE process against

    (a) polyserve's engine (continuous batching, rows of all tasks in every forward)
    (b) the same engine with adapters off (bare backbone: every row is `base`)
    (c) PEFT's Poly model + transformers `generate`, static batches of mixed task_ids
    (d) the same engine restricted to one task per batch (tasks served one after another)
    (t) = (a) with the rows' LoRA as torch ops (POLYSERVE_LORA_KERNEL=off), not the native kernel (the default)
    (w) = (a) with dense linears (POLYSERVE_WEIGHT_KERNEL=off): float32 copies of the weights, not the
        backbone's GGUF blocks (where the engine serves float32 and the backbone has them)
    (u) = (a), (v) = (b) served in float32 (a second engine; the others serve in --dtype, auto =
        bfloat16 on CPUs with AMX)
    (e) vLLM with the workload's tasks exported as PEFT LoRAs (the peer), float32; (E) bfloat16
    (f) vLLM bare backbone, float32; (F) bfloat16
        run by bench/vllm_peer.py in a vLLM environment (`make vllm-env`, or --vllm-python) on the
        same prompt strings and output lengths; vLLM reports throughput only (no TTFT/ITL here)
    (g) polyserve on its vLLM engine (server/engines/vllm), float32; (G) bfloat16: the same
        requests and resolved adapters as (a), through VllmEngine (also run by bench/vllm_peer.py)

All requests arrive at t=0 (offline). Output lengths are fixed per request (EOS ignored) so every
variant produces the same useful tokens; for (c) a batch runs until its longest request is done.
Reports output tokens/s, TTFT and inter-token latency p50/p99, and the ratios.

    .venv/bin/python -m bench.serve_bench --tasks 64 --requests 64 --threads 1

The script builds a random inventory of the shipped shape (S=8, h=8, r=8, attention targets) in a
temp store (a step's cost does not depend on the weights' values); --skills changes S, which a step's
cost should not depend on either: each row's tables are combined once, when it takes its slot.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import server  # noqa: F401  (before torch: OpenMP spin defaults, server/infra/openmp.py)
from server.infra import cpus, openmp

# isort: split
import torch

from adapters_store.backbone.load import load_backbone
from adapters_store.backbone.prompt import format_prompt
from adapters_store.lora.inject import RoutedModel
from adapters_store.lora.spec import ATTENTION_TARGETS, InventorySpec
from adapters_store.store.directory import DirectoryStore
from bench.schedstat import sched_delta, thread_times
from server.adapter_cache.cache import AdapterCache
from server.adapter_cache.l1 import L1Cache
from server.engines.dtype import dtype_name, serving_dtype
from server.engines.native.config import EngineConfig
from server.engines.native.core.engine import NativeEngine as Engine
from server.engines.native.tuning import Tuning
from server.engines.request import FinalEvent, GenRequest, RequestHandle, SamplingParams

WORDS = ["cat", "dog", "tree", "river", "stone", "cloud", "apple", "seven", "blue", "quick", "lamp", "music",
         "paper", "garden", "window", "orange", "silver", "market", "engine", "rabbit", "ocean", "winter",
         "bridge", "candle", "forest"]


class TimedHandle(RequestHandle):
    def __init__(self) -> None:
        super().__init__(None)
        self.times: list[float] = []

    def push(self, event) -> None:  # type: ignore[override]
        self.times.append(time.perf_counter())
        super().push(event)


def workload(n: int, tasks: list[str], out_min: int, out_max: int, seed: int,
             dist: str = "uniform") -> list[tuple[str, str, int]]:
    """(task, prompt, output length): prompts of 4-48 words; output lengths uniform or
    log-uniform (heavy-tailed, like chat traffic: many short answers, a few long ones). Tasks are
    drawn from their own generator, so every task count gets the same prompts and lengths."""
    rng = random.Random(seed)
    task_rng = random.Random(seed + 1)
    jobs = []
    for _ in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 48)))
        if dist == "loguniform":
            out = round(math.exp(rng.uniform(math.log(out_min), math.log(out_max))))
        else:
            out = rng.randint(out_min, out_max)
        jobs.append((task_rng.choice(tasks), format_prompt(words), out))
    return jobs


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def summary(name: str, wall: float, tokens: int, ttft: list[float], itl: list[float]) -> dict:
    return {"variant": name, "wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall,
            "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99),
            "itl_p50": pct(itl, 0.5), "itl_p99": pct(itl, 0.99)}


def merge_repeats(results: list[dict]) -> list[dict]:
    """Average repeated runs of one variant (means of every figure; a breakdown by process is kept
    for a single run only, its processes differ between runs)."""
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(r["variant"], []).append(r)
    out = []
    for name, runs in groups.items():
        merged = {"variant": name, "runs": len(runs)}
        for k in runs[0]:
            if isinstance(runs[0][k], (int, float)):
                merged[k] = statistics.fmean(r[k] for r in runs)
            elif k != "variant" and len(runs) == 1:
                merged[k] = runs[0][k]
        out.append(merged)
    return out


def build_inventory(bb, k: int, root: Path, seed: int, n_skills: int = 8):
    """Random skills in PEFT Poly's layout (B non-zero) and k routing rows; returns the PEFT model too."""
    import peft

    spec = InventorySpec(n_skills=n_skills, n_heads=8, rank=8, target_modules=ATTENTION_TARGETS)
    config = peft.PolyConfig(task_type="CAUSAL_LM", r=spec.rank, n_tasks=k, n_skills=spec.n_skills,
                             n_splits=spec.n_heads, target_modules=list(spec.target_modules), init_weights=False)
    torch.manual_seed(seed)
    pm = peft.get_peft_model(copy.deepcopy(bb.model), config).eval()
    layers = {n[len("base_model.model."):]: m for n, m in pm.named_modules() if hasattr(m, "poly_lora_A")}
    rm = RoutedModel(bb.model, spec)  # wraps bb.model in place
    logits = []
    with torch.no_grad():
        for name in rm.names:
            src = layers[name]
            src.poly_lora_B["default"].normal_(0, 0.02)  # small: outputs stay fluent but differ per task
            src.poly_router["default"].module_logits.normal_(0, 2)
            logits.append(src.poly_router["default"].module_logits.view(k, spec.n_heads, spec.n_skills))
        skills = {}
        for name in rm.names:
            skills[f"{name}.A"] = layers[name].poly_lora_A["default"].detach().float().cpu().clone()
            skills[f"{name}.B"] = layers[name].poly_lora_B["default"].detach().float().cpu().clone()
    rm.load_skills(skills)
    store = DirectoryStore(root)
    store.save_inventory(spec, rm.names, rm.layer_dims(), skills, backbone_fingerprint=bb.fingerprint,
                         backbone_name=bb.name, made_by={"method": "random-bench"})
    table = torch.stack(logits, dim=1).float().cpu()  # (k, L, h, S)
    tasks = [f"task-{t:03d}" for t in range(k)]
    for t, task in enumerate(tasks):
        store.put_routing(task, table[t].clone(), method="mhr")
    return store, rm, pm, tasks


def setup(args, dtype: torch.dtype, tmp: Path):
    """Backbone, a random inventory of args.tasks tasks, PEFT's copy, a warm L1 of their adapters."""
    bb = load_backbone(args.backbone, device=args.device, dtype="float32" if args.device == "cpu" else str(dtype)[6:])
    store, rm, pm, tasks = build_inventory(bb, args.tasks, tmp / "store", args.seed, n_skills=args.skills)
    info, skills = store.load_inventory(bb.fingerprint)
    # as the server with the native engine: routed tasks are their routing weights (slot_lora.py)
    cache = AdapterCache(store, info, skills, fingerprint=bb.fingerprint, device=bb.device,
                         dtype=next(bb.model.parameters()).dtype, l1=L1Cache(4 << 30), routing_layers=False)
    adapters = {t: cache.get(store.get_task(t)) for t in tasks}  # a warm L1 (steady state)
    return bb, store, rm, pm, tasks, adapters


def run_engine(engine: Engine, tok, jobs, adapters, name: str, *, base: bool = False, one_task: bool = False,
               temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """temperature 0: greedy; otherwise every request samples (unseeded, as most clients send)."""
    encoded = [(task, tok(p, add_special_tokens=False).input_ids, n) for task, p, n in jobs]
    groups: list[list[int]] = []
    if one_task:
        order: dict[str, list[int]] = {}
        for i, (task, _, _) in enumerate(encoded):
            order.setdefault(task, []).append(i)
        groups = list(order.values())
    else:
        groups = [list(range(len(encoded)))]
    t0 = time.perf_counter()
    reqs = []
    for group in groups:
        batch = []
        for i in group:
            task, ids, n = encoded[i]
            params = SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=temperature, top_p=top_p)
            req = GenRequest(list(ids), params, None if base else adapters[task], task, handle=TimedHandle())
            req.arrival = t0
            batch.append(engine.submit(req))
        for req in batch:
            req.handle.wait()
        reqs += batch
    wall = time.perf_counter() - t0
    ttft, itl, tokens = [], [], 0
    for req in reqs:
        times = req.handle.times
        assert isinstance(req.handle.events[-1], FinalEvent)
        tokens += req.handle.events[-1].completion_tokens
        ttft.append(times[0] - t0)
        itl += [b - a for a, b in itertools.pairwise(times)]
    return summary(name, wall, tokens, ttft, itl)


class StepTimes:
    """transformers streamer that records when each generation step's tokens appear."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_peft(pm, tok, jobs, tasks, batch_size: int) -> dict:
    task_index = {t: i for i, t in enumerate(tasks)}
    tok.padding_side = "left"
    t0 = time.perf_counter()
    ttft, itl, tokens = [], [], 0
    for start in range(0, len(jobs), batch_size):
        chunk = jobs[start : start + batch_size]
        enc = tok([p for _, p, _ in chunk], return_tensors="pt", padding=True, add_special_tokens=False).to(pm.device)
        longest = max(n for _, _, n in chunk)
        streamer = StepTimes()
        with torch.inference_mode():
            pm.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask,
                        task_ids=torch.tensor([task_index[t] for t, _, _ in chunk], device=pm.device),
                        max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                        pad_token_id=tok.pad_token_id, streamer=streamer)
        steps = streamer.times[1:]  # first put() is the prompt
        for _, _, n in chunk:
            tokens += n
            ttft.append(steps[0] - t0)
            itl += [b - a for a, b in itertools.pairwise(steps[:n])]
    return summary("(c) PEFT Poly + generate, static batches", time.perf_counter() - t0, tokens, ttft, itl)


def run_vllm(args, v: str, store: DirectoryStore, jobs: list[tuple[str, str, int]], tmp: Path) -> dict:
    """Variants e/f/E/F/g/G: vLLM in its own environment (a subprocess), same jobs."""
    from adapters_store.backbone.load import hf_dir
    from adapters_store.interop.peft_io import export_peft_lora

    if not args.vllm_python.is_file():
        raise SystemExit(f"variant {v} needs a vLLM environment: `make vllm-env` or --vllm-python ({args.vllm_python})")
    model = str(hf_dir(args.backbone))
    loras = tmp / "loras"
    for task in sorted({t for t, _, _ in jobs}):
        if not (loras / task).is_dir():
            export_peft_lora(store, task, loras / task, base_model=model)
    spec = tmp / "jobs.json"
    spec.write_text(json.dumps([{"task": t, "prompt": p, "out": n, "temperature": args.temperature, "top_p": args.top_p}
                                for t, p, n in jobs]))
    mode = "lora" if v in "eE" else "polyserve" if v in "gG" else "base"
    dtype = "float32" if v in "efg" else "bfloat16"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_KVCACHE_SPACE": "2"}
    cmd = [str(args.vllm_python), "-m", "bench.vllm_peer", "--jobs", str(spec),
           "--model", model, "--loras", str(loras), "--mode", mode, "--dtype", dtype, "--batch", str(args.batch),
           "--store", str(store.root)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False,
                         cwd=Path(__file__).resolve().parents[1])  # the repository root: bench is a package there
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"vLLM variant {v} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    got = json.loads(lines[-1])
    label = {"lora": "vLLM + exported LoRAs", "base": "vLLM bare", "polyserve": "polyserve on its vLLM engine"}[mode]
    nan = float("nan")
    return {"variant": f"({v}) {label}, {dtype}", "wall_s": got["seconds"], "tokens": got["tokens"],
            "tok_per_s": got["tok_per_s"],
            **{k: got.get(k, nan) for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")},
            **{k: got[k] for k in ("cpu_s", "runnable_wait_s", "cpu_s_by_process") if k in got}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backbone", default="default")
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--skills", type=int, default=8, help="skills of the random inventory (h = 8, r = 8, attention)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="max rows per batch (engine) = static batch size (c)")
    ap.add_argument("--out-min", type=int, default=8)
    ap.add_argument("--out-max", type=int, default=128)
    ap.add_argument("--out-dist", choices=["uniform", "loguniform"], default="uniform")
    ap.add_argument("--threads", type=lambda s: s if s == "auto" else int(s), default=1,
                    help="the engine's threads; auto: as the server sizes them (the CPUs this process may use: "
                         "server/infra/cpus.py)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (a, b, c, d run there; see bench/gpu_bench.sh)")
    ap.add_argument("--dtype", default="auto", help="the engine's serving dtype: auto (bfloat16 on CUDA and "
                    "AMX CPUs, else float32), float32, bfloat16")
    ap.add_argument("--max-step-tokens", type=int, default=256, help="tokens per engine step (chunked prefill)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default="abcd", help="letters run in this order; a repeated letter is "
                    "run again and averaged (e.g. abcab interleaves to even out a shared machine's drift)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--vllm-python", type=Path, default=Path(os.environ.get(
        "POLYSERVE_VLLM_PYTHON", Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python")),
        help="python of a vLLM environment for the variants e/f/E/F/g/G")
    ap.add_argument("--static-decode", choices=["auto", "on", "off"], default="auto",
                    help="the engine's POLYSERVE_STATIC_DECODE (CUDA graphs of decode steps; auto = on CUDA)")
    ap.add_argument("--adaptive-threads", choices=["on", "off"], default="on",
                    help="the engine's POLYSERVE_ADAPTIVE_THREADS (one thread while other processes hold the CPUs)")
    ap.add_argument("--contended", choices=["auto", "one", "helper"], default="auto",
                    help="native engine under contention: one thread alone, or with the weight kernel's panel "
                         "helper, or the helper where the linears have it (POLYSERVE_CONTENDED_HELPER)")
    ap.add_argument("--packed-weights", choices=["auto", "on", "off"], default="auto",
                    help="the engine's POLYSERVE_PACKED_WEIGHTS")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy (the default); above: every request samples, unseeded, in the engines and vLLM")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus of the sampled requests (with --temperature)")
    args = ap.parse_args()
    if not 1 <= args.out_min <= args.out_max:
        ap.error(f"output lengths need 1 <= --out-min <= --out-max; got --out-min {args.out_min} "
                 f"--out-max {args.out_max}")
    if args.temperature > 0 and set(args.variants) & set("cd"):
        ap.error("variants c and d run greedy only: drop --temperature or those variants")
    if args.threads == "auto":
        args.threads = cpus.default_threads()
        print(f"threads: {cpus.budget().describe()}", flush=True)
    # One OpenMP pool at a time, as in the server (server/infra/openmp.py): set-up runs in a thread that
    # ends, each engine variant gets an engine whose thread ends before the next, this thread only
    # submits and waits; PEFT's generate runs in a thread of its own while no engine is alive.
    torch.set_num_threads(args.threads)
    dtype = serving_dtype(args.device, None if args.dtype == "auto" else args.dtype)
    tmp = Path(tempfile.mkdtemp(prefix="polyserve-bench-"))
    bb, store, rm, pm, tasks, adapters = openmp.in_fresh_thread(setup, args, dtype, tmp)
    openmp.one_thread()
    jobs = workload(args.requests, tasks, args.out_min, args.out_max, args.seed, args.out_dist)

    def engine_run(serving: torch.dtype, name: str, lora_kernel: str = "auto", weight_kernel: str = "auto",
                   **kw) -> dict:
        def start() -> Engine:
            eng = Engine(bb.model, bb.tokenizer, rm, EngineConfig(
                max_batch_rows=args.batch, max_batch_tokens=1 << 20, max_prefill_rows=args.batch, max_queue=1 << 16,
                max_step_tokens=args.max_step_tokens, dtype=serving, threads=args.threads, tuning=Tuning(
                    packed_weights=args.packed_weights, static_decode=args.static_decode, lora_kernel=lora_kernel,
                    weight_kernel=weight_kernel, adaptive_threads=args.adaptive_threads == "on",
                    contended_helper={"auto": "auto", "one": "off", "helper": "on"}[args.contended])))
            eng.start()
            return eng

        eng = openmp.in_fresh_thread(start)
        try:
            run_engine(eng, bb.tokenizer, jobs[:4], adapters, "warm-up")
            before, steps = thread_times(), eng.steps
            how_before = dict(eng.execution.steps)
            out = run_engine(eng, bb.tokenizer, jobs, adapters, name, temperature=args.temperature,
                             top_p=args.top_p, **kw)
            out["steps"] = eng.steps - steps
            out["dtype"] = dtype_name(serving)  # "auto" resolves per process: say which
            how = {k: v - how_before[k] for k, v in eng.execution.steps.items()}
            out["one_thread_steps"] = how["one"] + how["helper"] if args.threads > 1 else out["steps"]
            out["contended_steps"] = {k: how[k] for k in ("one", "helper")}
            out.update(sched_delta(before, thread_times(), threads=4))  # the engine's, the helper's, a team's
            return out
        finally:
            eng.stop()

    def peft_run() -> dict:
        torch.set_num_threads(args.threads)
        return run_peft(pm, bb.tokenizer, jobs, tasks, args.batch)

    print(f"engine: {dtype}, {args.max_step_tokens} tokens per step, {args.threads} threads", flush=True)
    results = []
    for v in args.variants:
        if v == "a":
            results.append(engine_run(dtype, "(a) polyserve engine"))
        elif v == "b":
            results.append(engine_run(dtype, "(b) engine, adapters off", base=True))
        elif v == "t":
            results.append(engine_run(dtype, "(t) engine, LoRA as torch ops", lora_kernel="off"))
        elif v == "w":
            results.append(engine_run(dtype, "(w) engine, dense weights", weight_kernel="off"))
        elif v == "c":
            results.append(openmp.in_fresh_thread(peft_run))
        elif v in "uv":
            name = "(u) engine, float32" if v == "u" else "(v) engine, adapters off, float32"
            results.append(engine_run(torch.float32, name, base=v == "v"))
        elif v in "efEFgG":
            results.append(run_vllm(args, v, store, jobs, tmp))
        elif v == "d":
            results.append(engine_run(dtype, "(d) engine, one task per batch", one_task=True))
        r = results[-1]
        print(f"{r['variant']:45s} {r['tok_per_s']:8.1f} tok/s  TTFT p50 {r['ttft_p50']:.2f}s p99 {r['ttft_p99']:.2f}s"
              f"  ITL p50 {1000 * r['itl_p50']:.0f}ms p99 {1000 * r['itl_p99']:.0f}ms  ({r['wall_s']:.0f}s"
              + (f"; {r['steps']} steps ({r['one_thread_steps']} without the team, {args.contended}: "
                 f"{', '.join(f'{k} {v}' for k, v in r['contended_steps'].items() if v) or 'none'})"
                 if "steps" in r else "")
              + (f", CPU {r['cpu_s']:.1f}s, waited runnable {r['runnable_wait_s']:.1f}s" if "cpu_s" in r else "")
              + (f" [{', '.join(f'{k} {s:.1f}s' for k, s in r['cpu_s_by_process'].items())}]"
                 if "cpu_s_by_process" in r else "")
              + (f" [threads: {', '.join(f'{k} {v[0]:.1f}s' for k, v in r['cpu_s_by_thread'].items())}]"
                 if "cpu_s_by_thread" in r else "")
              + ")", flush=True)
    results = merge_repeats(results)
    if len(args.variants) > len(set(args.variants)):
        for r in results:
            print(f"mean of {r['runs']}: {r['variant']:37s} {r['tok_per_s']:8.1f} tok/s  TTFT p50 {r['ttft_p50']:.2f}s "
                  f"p99 {r['ttft_p99']:.2f}s  ITL p50 {1000 * r['itl_p50']:.0f}ms p99 {1000 * r['itl_p99']:.0f}ms")
    by = {r["variant"][1]: r["tok_per_s"] for r in results}
    pairs = [("a", "b"), ("t", "b"), ("a", "t"), ("a", "w"), ("a", "c"), ("a", "d"), ("a", "u"), ("b", "v")]
    pairs += [(x, y) for x in "ab" for y in "efEF"] + [("e", "f"), ("E", "F"), ("g", "e"), ("G", "E"), ("g", "a")]
    for x, y in pairs:
        if x in by and y in by:
            print(f"({x})/({y}) output tokens/s ratio: {by[x] / by[y]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args), "results": results}, indent=2, default=str))


if __name__ == "__main__":
    main()
