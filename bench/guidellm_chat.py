"""guidellm (the vLLM project's load client), unchanged, on a multi-turn chat against polyserve's
server and vLLM's OpenAI server (prefix cache on), one after the other in one run.

guidellm's synthetic multi-turn data: --turns turns, each turn's prompt the conversation so far
(--prompt-tokens new tokens a turn after one of --prefix-count shared --prefix-tokens-token system
prompts), --output-tokens a turn, --streams conversations at a time, streamed. Prints one JSON
line per server (guidellm's own request totals and output tokens/s) and their ratio.

    make vllm-env
    .venv/bin/python -m bench.guidellm_chat --threads 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from bench.vllm_client_bench import ROOT, start, stop


def guidellm(args: argparse.Namespace, url: str, model: str, tokenizer: Path, report: Path) -> dict:
    exe = Path(sys.executable).with_name("guidellm")
    cmd = [str(exe if exe.exists() else shutil.which("guidellm")), "run",
           "--backend", f"kind=openai_http,target={url},model={model},request_format=/v1/chat/completions",
           "--profile", f"kind=concurrent,streams={args.streams}",
           "--constraint", f"kind=max_requests,count={args.requests}",
           "--data", (f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens},"
                      f"turns={args.turns},prefix_tokens={args.prefix_tokens},prefix_count={args.prefix_count}"),
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
           "--output", f"kind=json,path={report}", "--disable-console-interactive"]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=args.timeout, cwd=report.parent)
    if run.returncode != 0:
        raise SystemExit(f"guidellm failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    metrics = benchmark["metrics"]
    rate = metrics["output_tokens_per_second"]["successful"]["mean"]
    return {"requests": metrics["request_totals"], "output_tok_s": round(rate, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--prefix-tokens", type=int, default=128)
    ap.add_argument("--prefix-count", type=int, default=4)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--servers", default="polyserve,vllm")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--vllm-kv-gib", type=int, default=2)
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/guidellm-chat"))
    args = ap.parse_args()
    args.max_concurrency, args.tasks = 16, 1  # what bench.vllm_client_bench.start reads
    args.vllm_args = ["--enable-prefix-caching", "--max-model-len", "2048"]

    from adapters_store.backbone.load import hf_dir

    model_dir = hf_dir("default")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rates = {}
    for kind in args.servers.split(","):
        proc, handle, url = start(kind, args, args.out_dir, {"POLYSERVE_MAX_PROMPT_TOKENS": "2048"}, model_dir)
        try:
            row = guidellm(args, url, "base" if kind == "polyserve" else str(model_dir), model_dir,
                           args.out_dir / f"{kind}.json")
            if kind == "polyserve":  # what its prefix cache found
                text = httpx.get(url + "/metrics", timeout=10).text
                found = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                         if line.startswith("polyserve_prefix_cache_")}
                row["prefix_cache_hit_share"] = round(found["polyserve_prefix_cache_hit_tokens_total"]
                                                      / max(1.0, found["polyserve_prefix_cache_query_tokens_total"]), 3)
        finally:
            stop(proc, handle)
        rates[kind] = row["output_tok_s"]
        print(json.dumps({"server": kind, **row}), flush=True)
    if "polyserve" in rates and "vllm" in rates:
        print(json.dumps({"output_tok_s_ratio": round(rates["polyserve"] / rates["vllm"], 2)}), flush=True)


if __name__ == "__main__":
    main()
