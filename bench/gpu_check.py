"""Does the native engine give the same answers on a GPU whichever path a decode step takes?

The CPU tests check the padded static decode (static_decode.py) against the dynamic path eagerly;
only a CUDA machine replays the captured graphs. This runs one mixed batch (rows of several routed
tasks and base rows, greedy, a fixed number of tokens) three ways on --device:

    static   the engine with POLYSERVE_STATIC_DECODE on (CUDA graphs on CUDA)
    dynamic  the same engine with it off
    solo     each request alone on the dynamic engine (the batched-equals-alone oracle)

and prints, against solo: how many requests gave the same tokens, and the largest difference of a
chosen token's logprob before the first differing token; exits 1 unless every request agrees
within --atol (float32 by default: a flip in bfloat16 on
a random model's near-flat logits says little). Requests ask for 1/3, 2/3 or all of --tokens, so
rows leave and the step's bucket shrinks; --tokens past the cache's first capacity
(slots.MIN_CAPACITY) makes the KV cache grow while graphs are captured (each growth recaptures
them), and --rounds 2 runs the batch again after the engine went idle (the cache shrinks back:
recaptured again).

    python -m bench.gpu_check --backbone DIR --device cuda [--dtype float32] [--tokens 300 --rounds 2]
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
from pathlib import Path

import server  # noqa: F401  (before torch: OpenMP spin defaults, server/infra/openmp.py)
from server.infra import openmp

# isort: split
import torch

from adapters_store.backbone.load import load_backbone
from adapters_store.backbone.prompt import format_prompt
from bench.serve_bench import WORDS, build_inventory
from server.adapter_cache.cache import AdapterCache
from server.adapter_cache.l1 import L1Cache
from server.engines.native.config import EngineConfig
from server.engines.native.core.engine import NativeEngine
from server.engines.native.tuning import Tuning
from server.engines.request import FinalEvent, GenRequest, SamplingParams, TokenEvent


def answers(handle) -> tuple[list[int], list[float]]:
    tokens, logprobs = [], []
    for ev in handle.events:
        if isinstance(ev, TokenEvent):
            tokens.append(ev.token_id)
            logprobs += [lp.logprob for lp in ev.logprobs or []]
        elif isinstance(ev, FinalEvent):
            if ev.error:
                raise SystemExit(f"request failed: {ev.error}")
            logprobs += [lp.logprob for lp in ev.logprobs or []]
    return tokens, logprobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backbone", default="tiny")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tasks", type=int, default=6)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--atol", type=float, default=1e-4, help="largest logprob difference that passes "
                    "(float32: rounding passes it, a decode step that leaves out the rows' LoRA does not)")
    ap.add_argument("--rounds", type=int, default=1, help="run the batched variants this many times")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    bb = load_backbone(args.backbone, device=args.device, dtype=args.dtype)
    store, rm, _, tasks = build_inventory(bb, args.tasks, Path(tempfile.mkdtemp(prefix="polyserve-gpucheck-")), 0)
    info, skills = store.load_inventory(bb.fingerprint)
    cache = AdapterCache(store, info, skills, fingerprint=bb.fingerprint, device=bb.device, dtype=dtype,
                         l1=L1Cache(1 << 30), routing_layers=False)
    # every third request is base: base rows share steps with routed ones
    jobs = [(None if i % 3 == 2 else tasks[i % len(tasks)], format_prompt(" ".join(WORDS[(i * 7 + j) % len(WORDS)]
            for j in range(4 + 5 * i)))) for i in range(args.requests)]
    encoded = [(task, bb.tokenizer(p, add_special_tokens=False).input_ids) for task, p in jobs]
    adapters = {t: cache.get(store.get_task(t)) for t in tasks}
    captures: dict[bool, int] = {}
    lengths = [max(1, args.tokens * (1 + i % 3) // 3) for i in range(len(encoded))]

    def run(static: bool, groups: list[list[int]], rounds: int = 1) -> list[list[tuple[list[int], list[float]]]]:
        def start() -> NativeEngine:
            eng = NativeEngine(bb.model, bb.tokenizer, rm, EngineConfig(
                max_batch_rows=16, max_batch_tokens=1 << 16, max_prefill_rows=16, max_queue=1 << 10,
                max_step_tokens=256, dtype=dtype, tuning=Tuning(static_decode="on" if static else "off")))
            eng.start()
            return eng

        eng = openmp.in_fresh_thread(start)
        results = []
        try:
            for _ in range(rounds):
                out: dict[int, tuple[list[int], list[float]]] = {}
                for group in groups:
                    reqs = {i: eng.submit(GenRequest(list(encoded[i][1]), SamplingParams(
                        max_new_tokens=lengths[i], ignore_eos=True, logprobs=0),
                        None if encoded[i][0] is None else adapters[encoded[i][0]], encoded[i][0] or "base"))
                        for i in group}
                    for i, req in reqs.items():
                        req.handle.wait()
                        out[i] = answers(req.handle)
                results.append([out[i] for i in range(len(encoded))])
        finally:
            eng.stop()
        static_path = getattr(eng.runner, "static", None)
        captures[static] = static_path.captures if static_path is not None else 0
        return results

    everyone = [list(range(len(encoded)))]
    solo = run(False, [[i] for i in range(len(encoded))])[0]
    print(f"{args.device}, {args.dtype}, {len(encoded)} requests ({len(tasks)} tasks + base), "
          f"{min(lengths)}-{max(lengths)} tokens each, {args.rounds} round(s)")
    failed = False
    for (name, static), r in itertools.product((("static", True), ("dynamic", False)), range(args.rounds)):
        if r == 0:
            rounds = run(static, everyone, args.rounds)
        got = rounds[r]
        name = f"{name} #{r + 1}"
        same, worst = 0, 0.0
        for (tok, lp), (want, want_lp) in zip(got, solo, strict=True):
            same += tok == want
            agree = next((k for k, (a, b) in enumerate(zip(tok, want, strict=True)) if a != b), len(tok))
            worst = max([worst] + [abs(a - b) for a, b in zip(lp[:agree + 1], want_lp[:agree + 1], strict=True)])
        print(f"{name:10s} batched vs solo: {same}/{len(solo)} requests give the same tokens; "
              f"largest chosen-token logprob difference {worst:.2e}")
        failed |= same < len(solo) or worst > args.atol
    print(f"graphs captured by the static engine: {captures[True]} (0 off CUDA: its padded steps run eagerly)")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
