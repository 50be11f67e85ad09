"""The peer, run inside a vLLM environment by bench/serve_bench.py (variants e/f/E/F): vLLM's
offline engine on exactly serve_bench's workload (the same prompt strings and output lengths),
with our tasks exported as PEFT LoRAs (`--mode lora`) or the bare backbone (`--mode base`).

    .venv-vllm/bin/python bench/vllm_peer.py --jobs jobs.json --model DIR --loras DIR \
        --mode lora --dtype float32 --batch 16

jobs.json: [{"task", "prompt", "out"}, ...]. Prints one JSON line: tokens, seconds, tok/s.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=Path, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--loras", type=Path)
    ap.add_argument("--mode", choices=["lora", "base"], default="lora")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-lora-rank", type=int, default=8)
    args = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    jobs = json.loads(args.jobs.read_text())
    tasks = sorted({j["task"] for j in jobs})
    lora = args.mode == "lora"
    llm = LLM(model=args.model, dtype=args.dtype, enable_lora=lora, max_lora_rank=args.max_lora_rank,
              max_loras=min(args.batch, len(tasks)), max_num_seqs=args.batch, max_model_len=1024)
    ids = {t: i + 1 for i, t in enumerate(tasks)}
    prompts = [j["prompt"] for j in jobs]
    params = [SamplingParams(max_tokens=j["out"], min_tokens=j["out"], ignore_eos=True, temperature=0.0) for j in jobs]
    loras = [LoRARequest(j["task"], ids[j["task"]], str(args.loras / j["task"])) for j in jobs] if lora else None
    llm.generate(prompts[:2], params[:2], lora_request=loras[:2] if loras else None, use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"mode": args.mode, "dtype": args.dtype, "tokens": tokens, "seconds": seconds,
                      "tok_per_s": tokens / seconds}), flush=True)


if __name__ == "__main__":
    main()
