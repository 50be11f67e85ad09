"""Registering a task while serving, on the default backbone and the shipped inventory.

Measures, in one process:
  1. serving throughput (output tokens/s) of a closed-loop mixed-task workload with no job,
  2. the same workload while a registration job (routing-only, k examples of a held-out
     procedural task) runs in the engine's background slices -> "throughput kept" = 2 / 1,
  3. the same registration on an idle server: wall time (target <= 30 s on 2 cores),
  4. the registered task's exact match on its test split vs zero-shot μ (all-zero routing logits).

    .venv/bin/python -m bench.adapt_while_serving --clients 8 --k 16 --json /tmp/adapt.json [--method retrieve]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from pathlib import Path

import server  # noqa: F401  (before torch: OpenMP spin defaults, server/infra/openmp.py)
from server.infra import openmp

# isort: split
import torch

from adapters_store.backbone.prompt import format_prompt
from server.engines.request import GenRequest, SamplingParams
from server.infra.metrics import Metrics
from server.wiring.runtime import Runtime
from server.wiring.settings import Settings
from training.suite import build_suite, examples


def closed_loop(rt: Runtime, tasks: list[str], prompts: list[str], clients: int, new_tokens: int,
                until: threading.Event | None, seconds: float) -> tuple[float, int]:
    """`clients` threads each keep one request in flight; returns (tokens/s, tokens)."""
    adapters = {t: rt.registry.resolve(t) for t in tasks}
    tokens = [0] * clients
    stop = threading.Event()

    def client(i: int) -> None:
        rng = random.Random(i)
        while not stop.is_set():
            task = rng.choice(tasks)
            ids = rt.tokenizer(format_prompt(rng.choice(prompts)), add_special_tokens=False).input_ids
            req = GenRequest(list(ids), SamplingParams(max_new_tokens=new_tokens, ignore_eos=True),
                             adapter=adapters[task], task=task)
            rt.engine.submit(req)
            req.handle.wait()
            tokens[i] += req.handle.events[-1].completion_tokens  # the FinalEvent

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    if until is not None:
        until.wait()
    else:
        time.sleep(seconds)
    stop.set()
    elapsed = time.perf_counter() - started
    before = sum(tokens)
    for t in threads:
        t.join()
    return before / elapsed, before


def exact_match(rt: Runtime, task: str, test: list) -> float:
    adapter = rt.registry.resolve(task)
    hits = 0
    reqs = []
    for ex in test:
        ids = rt.tokenizer(format_prompt(ex.input), add_special_tokens=False).input_ids
        reqs.append(GenRequest(list(ids), SamplingParams(max_new_tokens=32), adapter=adapter, task=task))
        rt.engine.submit(reqs[-1])
    for req, ex in zip(reqs, test, strict=True):
        req.handle.wait()
        text = "".join(getattr(e, "text", "") for e in req.handle.events).strip()
        hits += text == ex.output.strip()
    return hits / len(test)


def run_job(rt: Runtime, task: str, train: list, steps: int | None, seed: int,
            method: str = "routing") -> tuple[dict, float]:
    started = time.perf_counter()
    job = rt.registration.submit(task, [{"input": e.input, "output": e.output} for e in train], method,
                                 steps, seed)
    while not rt.registration.job(job.id).finished:
        time.sleep(0.05)
    return rt.registration.job(job.id).to_public(), time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--n-test", type=int, default=32)
    ap.add_argument("--baseline-seconds", type=float, default=60)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--method", default="routing", choices=["routing", "retrieve", "mu", "full"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout", default=None, help="held-out task for the traffic run (default: the first one)")
    ap.add_argument("--accuracy-tasks", type=int, default=4, help="held-out tasks registered for the accuracy table")
    ap.add_argument("--background-share", type=float, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    home = Path(tempfile.mkdtemp(prefix="polyserve-adapt-bench-"))
    extra = {} if args.background_share is None else {"background_share": args.background_share}
    settings = Settings(home=home, store=home / "store", backbone="default", redis_url=None, **extra)
    import os

    os.environ.setdefault("POLYSERVE_HOME", str(Path.home() / ".cache" / "polyserve"))  # backbone cache
    rt = openmp.in_fresh_thread(Runtime.build, settings, Metrics())  # one OpenMP pool: the engine's (openmp.py)
    openmp.one_thread()
    suite = build_suite()
    held = next(t for t in suite.heldout_tasks if args.heldout in (None, t.name))
    train = examples(held, args.k, seed=args.seed, split="train")
    info = rt.store.inventory_info()
    rt.store.put_routing("mu-zero", torch.zeros(len(info.layer_names), info.spec.n_heads, info.spec.n_skills),
                         method="mu")
    serving = [r.id for r in rt.store.list_tasks() if r.status == "ready" and r.id != "mu-zero"]
    prompts = [e.input for t in suite.train_tasks[:8] for e in examples(t, 4, seed=1, split="valid")]

    base_tps, _ = closed_loop(rt, serving, prompts, args.clients, args.new_tokens, None, args.baseline_seconds)
    done = threading.Event()
    result: dict = {}

    def job_thread() -> None:
        result["job"], result["wall"] = run_job(rt, "bench-busy", train, args.steps, args.seed, args.method)
        done.set()

    threading.Thread(target=job_thread, daemon=True).start()
    busy_tps, _ = closed_loop(rt, serving, prompts, args.clients, args.new_tokens, done, 0)
    per_task = []
    for task in suite.heldout_tasks[: args.accuracy_tasks]:
        task_train = examples(task, args.k, seed=args.seed, split="train")
        task_test = examples(task, args.n_test, seed=args.seed, split="test")
        job, wall = run_job(rt, f"{task.name}-k{args.k}", task_train, args.steps, args.seed, args.method)
        per_task.append({"task": task.name, "status": job["status"], "wall_s_idle": round(wall, 2),
                         "steps_run": job["metrics"].get("steps_run"),
                         "adapt_s": job["metrics"].get("seconds"),
                         "exact_match_registered": exact_match(rt, f"{task.name}-k{args.k}", task_test),
                         "exact_match_mu": exact_match(rt, "mu-zero", task_test)})
        print(json.dumps(per_task[-1]), flush=True)
    mean = lambda key: round(sum(t[key] for t in per_task) / len(per_task), 3)
    out = {
        "method": args.method, "heldout_task": held.name, "k": args.k, "clients": args.clients,
        "new_tokens": args.new_tokens,
        "tokens_per_s_no_job": round(base_tps, 2), "tokens_per_s_during_job": round(busy_tps, 2),
        "throughput_kept": round(busy_tps / base_tps, 3),
        "job_wall_s_under_load": round(result["wall"], 2), "job_status_under_load": result["job"]["status"],
        "mean_job_wall_s_idle": mean("wall_s_idle"), "mean_exact_match_registered": mean("exact_match_registered"),
        "mean_exact_match_mu": mean("exact_match_mu"), "n_test": args.n_test, "per_task": per_task,
        "background_share": settings.background_share, "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    rt.close()


if __name__ == "__main__":
    main()
