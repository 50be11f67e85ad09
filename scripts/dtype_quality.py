"""Does serving in bfloat16 cost the shipped tasks accuracy? The native engine in float32 and in
bfloat16 on the same requests: the shipped inventory's training tasks (their test split), greedy,
through the engine with the tasks' adapters (as /v1/generate serves them: the task's prompt
format, no special tokens), and the plain backbone on chat prompts.

Reports exact match per dtype, the share of answers identical between the two, and the
backbone's own agreement (greedy 16 tokens).

    .venv/bin/python -m scripts.dtype_quality --examples 8 --threads 2
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import server  # noqa: F401  (before torch: OpenMP spin defaults, server/infra/openmp.py)
from server.infra import openmp

# isort: split
import torch

from adapters_store.backbone.load import load_backbone
from adapters_store.backbone.prompt import format_prompt
from adapters_store.lora.inject import RoutedModel
from adapters_store.store.directory import DirectoryStore
from server.adapter_cache.cache import AdapterCache
from server.adapter_cache.l1 import L1Cache
from server.engines.native.config import EngineConfig
from server.engines.native.core.engine import NativeEngine
from server.engines.request import GenRequest, SamplingParams
from training.evaluate import exact
from training.shipped_inventory import install_default_inventory
from training.suite import build_suite, examples

CHAT = ["What is the capital of France?", "Name three colours.", "Write a haiku about the sea.",
        "Explain photosynthesis in one sentence.", "What is 7 times 8?", "Give me a synonym for happy.",
        "Translate 'good morning' to French.", "Who wrote Hamlet?"]


def run(engine: NativeEngine, jobs: list[tuple[list[int], object, int]]) -> list[list[int]]:
    reqs = [engine.submit(GenRequest(ids, SamplingParams(max_new_tokens=n, logprobs=0), adapter))
            for ids, adapter, n in jobs]
    for r in reqs:
        if not r.handle.wait(600):
            raise SystemExit("a request did not finish")
    return [[lp.token_id for e in r.handle.events for lp in (e.logprobs or [])] for r in reqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=8, help="test examples per task")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    def setup():
        bb = load_backbone("default")
        store = DirectoryStore(Path(tempfile.mkdtemp(prefix="polyserve-dtype-")) / "store")
        if not install_default_inventory(store):
            raise SystemExit("no shipped default inventory")
        info, skills = store.load_inventory(bb.fingerprint)
        rm = RoutedModel(bb.model, info.spec)
        rm.load_skills(skills)
        cache = AdapterCache(store, info, skills, fingerprint=bb.fingerprint, device=bb.device,
                             dtype=torch.float32, l1=L1Cache(1 << 32))
        return bb, store, rm, cache

    bb, store, rm, cache = openmp.in_fresh_thread(setup)
    openmp.one_thread()
    tok = bb.tokenizer
    tasks = [t for t in build_suite().train_tasks if store.has_task(t.name)]
    refs, jobs = [], []
    for t in tasks:
        adapter = cache.get(store.get_task(t.name))
        for ex in examples(t, args.examples, seed=0, split="test"):
            ids = list(tok(format_prompt(ex.input), add_special_tokens=False).input_ids)
            refs.append(ex.output)
            jobs.append((ids, adapter, len(tok(" " + ex.output, add_special_tokens=False).input_ids) + 4))
    chat = [(list(tok(tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                              add_generation_prompt=True),
                      add_special_tokens=False).input_ids), None, 16) for c in CHAT]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        engine = openmp.in_fresh_thread(lambda d=dtype: NativeEngine(bb.model, tok, rm, EngineConfig(
            dtype=d, threads=args.threads, max_batch_rows=args.batch, max_batch_tokens=1 << 20, max_queue=1 << 16)))
        engine.start()
        try:
            out[dtype] = (run(engine, jobs), run(engine, chat))
        finally:
            engine.stop()
    print(f"{len(tasks)} shipped tasks x {args.examples} test examples = {len(jobs)} requests, greedy; "
          f"{len(chat)} chat prompts to the plain backbone")
    for dtype, (answers, _) in out.items():
        em = sum(exact(tok.decode(a, skip_special_tokens=True), ref) for a, ref in zip(answers, refs, strict=True))
        print(f"  {str(dtype)[6:]:9s} exact match {em / len(refs):.3f} ({em}/{len(refs)})")
    (a32, c32), (a16, c16) = out[torch.float32], out[torch.bfloat16]
    same = sum(x == y for x, y in zip(a32, a16, strict=True))
    print(f"  task answers identical in both dtypes: {same}/{len(a32)}")
    print(f"  chat answers (16 tokens) identical: {sum(x == y for x, y in zip(c32, c16, strict=True))}/{len(CHAT)}")


if __name__ == "__main__":
    main()
