"""One decode step of the plain backbone (no adapters, no engine) with each way of running its
linear layers, interleaved in one process: float32 dense (MKL sgemm via F.linear), float32 packed
(oneDNN, server/engines/native/packed.py), bfloat16 dense. Also checks greedy tokens agree.

    flock -x /tmp/polyserve-cpu.lock .venv/bin/python bench/linear_paths.py --rows 16 --context 100
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters_store.backbone import load_backbone
from server.engines.native import packed


def step_times(model, ids: torch.Tensor, steps: int) -> tuple[float, float, torch.Tensor]:
    """(prefill seconds, median decode-step seconds, greedy tokens)."""
    with torch.inference_mode():
        t = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        prefill = time.perf_counter() - t
        cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        toks, times = [tok], []
        for _ in range(steps):
            t = time.perf_counter()
            out = model(input_ids=tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t)
            toks.append(tok)
    return prefill, statistics.median(times[2:]), torch.cat(toks, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backbone", default="default")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fp32 = load_backbone(args.backbone).model.eval()
    bf16 = load_backbone(args.backbone, dtype="bfloat16").model.eval()
    packed.pack_linears(fp32)
    ids = torch.randint(100, 5000, (args.rows, args.context), generator=torch.Generator().manual_seed(0))
    variants = {
        "float32 dense": (fp32, False), "float32 packed (oneDNN)": (fp32, True), "bfloat16 dense": (bf16, False),
    }
    seen: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    tokens: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats):
        for name, (model, on) in variants.items():
            packed.set_packed(fp32, on)
            pre, dec, tokens[name] = step_times(model, ids, args.steps)
            seen[name].append((pre, dec))
    base = statistics.median(d for _, d in seen["float32 dense"])
    print(f"{args.backbone}: {args.rows} rows, context {args.context}, {args.threads} threads, "
          f"median of {args.repeats}")
    for name, runs in seen.items():
        pre = statistics.median(p for p, _ in runs)
        dec = statistics.median(d for _, d in runs)
        same = torch.equal(tokens[name], tokens["float32 dense"])
        print(f"{name:26s} prefill {1000 * pre:7.0f} ms   decode step {1000 * dec:6.1f} ms  "
              f"(x{base / dec:.2f} vs float32 dense)  greedy tokens equal: {same}")


if __name__ == "__main__":
    main()
