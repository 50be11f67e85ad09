"""The peer, run inside a vLLM environment by bench/serve_bench.py (variants e/f/E/F): vLLM's
offline engine on exactly serve_bench's workload (the same prompt strings and output lengths),
with our tasks exported as PEFT LoRAs (`--mode lora`) or the bare backbone (`--mode base`); and
variant (g), polyserve's own vLLM engine (`--mode polyserve --store DIR`): the same requests as
(a), each with its task's adapter resolved through a warm L1 (as the server resolves it), submitted
to server.engines.vllm.engine.VllmEngine (AsyncLLM) at t=0; the tasks' PEFT directories are
written before the clock starts (steady state, as (e) exports them beforehand).

    .venv-vllm/bin/python -m bench.vllm_peer --jobs jobs.json --model DIR --loras DIR \
        --mode lora --dtype float32 --batch 16

jobs.json: [{"task", "prompt", "out", "temperature"?, "top_p"?}, ...] (greedy where absent).
Prints one JSON line: tokens, seconds, tok/s, and (e/f) the CPU seconds vLLM's processes got
during the timed run and waited runnable, by process (bench/schedstat.py: its engine core is a
child process).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench import schedstat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=Path, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--loras", type=Path)
    ap.add_argument("--mode", choices=["lora", "base", "polyserve"], default="lora")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-lora-rank", type=int, default=8)
    ap.add_argument("--store", type=Path, help="--mode polyserve: the store the workload's tasks come from")
    args = ap.parse_args()
    if args.mode == "polyserve":
        run_polyserve(args, json.loads(args.jobs.read_text()))
        return
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    jobs = json.loads(args.jobs.read_text())
    tasks = sorted({j["task"] for j in jobs})
    lora = args.mode == "lora"
    llm = LLM(model=args.model, dtype=args.dtype, enable_lora=lora, max_lora_rank=args.max_lora_rank,
              max_loras=min(args.batch, len(tasks)), max_num_seqs=args.batch, max_model_len=1024)
    ids = {t: i + 1 for i, t in enumerate(tasks)}
    prompts = [j["prompt"] for j in jobs]
    params = [SamplingParams(max_tokens=j["out"], min_tokens=j["out"], ignore_eos=True,
                             temperature=j.get("temperature", 0.0), top_p=j.get("top_p", 1.0)) for j in jobs]
    loras = [LoRARequest(j["task"], ids[j["task"]], str(args.loras / j["task"])) for j in jobs] if lora else None
    llm.generate(prompts[:2], params[:2], lora_request=loras[:2] if loras else None, use_tqdm=False)  # warm-up
    pids = schedstat.tree()
    before = schedstat.thread_times(pids)
    started = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    seconds = time.perf_counter() - started
    cpu = schedstat.sched_delta(before, schedstat.thread_times(pids), schedstat.process_names(pids))
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"mode": args.mode, "dtype": args.dtype, "tokens": tokens, "seconds": seconds,
                      "tok_per_s": tokens / seconds, **cpu}), flush=True)


def run_polyserve(args, jobs: list[dict]) -> None:
    import itertools
    import tempfile

    import torch
    from transformers import AutoTokenizer

    from adapters_store.store.directory import DirectoryStore
    from bench.serve_bench import TimedHandle
    from server.adapter_cache.cache import AdapterCache
    from server.adapter_cache.l1 import L1Cache
    from server.engines.request import FinalEvent, GenRequest, SamplingParams
    from server.engines.vllm.engine import VllmEngine

    store = DirectoryStore(args.store)
    info, skills = store.load_inventory()
    cache = AdapterCache(store, info, skills, fingerprint=info.backbone_fingerprint, device=torch.device("cpu"),
                         dtype=torch.float32, l1=L1Cache(4 << 30))
    tasks = sorted({j["task"] for j in jobs})
    adapters = {t: cache.get(store.get_task(t)) for t in tasks}
    tok = AutoTokenizer.from_pretrained(args.model)
    engine = VllmEngine(args.model, tok, lora_root=tempfile.mkdtemp(prefix="polyserve-g-"), inventory=info,
                        max_batch_rows=args.batch, max_batch_tokens=1 << 20, max_queue=1 << 16, dtype=args.dtype,
                        max_model_len=1024)
    engine.start()
    for adapter in adapters.values():
        engine.loras.ensure(adapter)  # type: ignore[union-attr]

    def run(batch: list[dict]) -> tuple[float, list[GenRequest]]:
        t0 = time.perf_counter()
        reqs = []
        for j in batch:
            ids = tok(j["prompt"], add_special_tokens=False).input_ids
            params = SamplingParams(max_new_tokens=j["out"], ignore_eos=True, temperature=j.get("temperature", 0.0),
                                    top_p=j.get("top_p", 1.0))
            req = GenRequest(list(ids), params,
                             adapters[j["task"]], j["task"], handle=TimedHandle())
            req.arrival = t0
            reqs.append(engine.submit(req))
        for req in reqs:
            req.handle.wait()
        return t0, reqs

    run(jobs[:2])  # warm-up, as for (e)
    t0, reqs = run(jobs)
    seconds = time.perf_counter() - t0
    tokens, ttft, itl = 0, [], []
    for req in reqs:
        final = req.handle.events[-1]
        assert isinstance(final, FinalEvent) and final.error is None, final
        tokens += final.completion_tokens
        ttft.append(req.handle.times[0] - t0)
        itl += [b - a for a, b in itertools.pairwise(req.handle.times)]
    engine.stop()
    ttft.sort()
    itl.sort()
    pick = lambda xs, q: xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")
    print(json.dumps({"mode": "polyserve", "dtype": args.dtype, "tokens": tokens, "seconds": seconds,
                      "tok_per_s": tokens / seconds, "ttft_p50": pick(ttft, 0.5), "ttft_p99": pick(ttft, 0.99),
                      "itl_p50": pick(itl, 0.5), "itl_p99": pick(itl, 0.99)}), flush=True)


if __name__ == "__main__":
    main()
