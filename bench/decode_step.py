"""Time of one engine decode step (forward + sampling + bookkeeping) for a batch of N `base` rows,
per sampling variant, side by side in one process. Drives NativeEngine.step() directly (no
thread, no HTTP): N requests are admitted and prefilled, then `--steps` decode steps are timed.

    flock -x /tmp/polyserve-cpu.lock .venv/bin/python -m bench.decode_step --backbone tiny
    flock -x /tmp/polyserve-cpu.lock .venv/bin/python -m bench.decode_step --backbone default --steps 20

Variants (all rows of a batch use the same one): greedy (the common path: one vectorised argmax),
and, when the engine supports them, sampled, greedy+penalties, greedy+logprobs(5).
Reports the median step time over `--repeats` runs of each variant (variants interleaved), and each
run's. `--weight-kernels off on`: greedy steps on dense float32 weights against the backbone's GGUF
blocks (server/engines/native/kernels/quant_linear.py), taking turns. `--dtypes bfloat16 float32
--weight-kernels off on`: the engine serving bf16 on dense weights against float32 on the blocks
(the settings pair up; one value of either applies to every turn).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch

from adapters_store.backbone.load import load_backbone
from server.engines.native.config import EngineConfig
from server.engines.native.core.engine import NativeEngine
from server.engines.native.tuning import Tuning
from server.engines.request import GenRequest, SamplingParams


def variants(max_new: int) -> dict[str, SamplingParams]:
    base = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    out = {"greedy": base, "sampled": dataclasses.replace(base, temperature=0.8, top_p=0.9, seed=1)}
    extra: dict[str, dict] = {
        "greedy+penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
        "greedy+logprobs5": {"logprobs": 5},
    }
    for name, fields in extra.items():
        params = dataclasses.replace(base, **fields)
        unsupported = getattr(sys.modules[NativeEngine.__module__], "unsupported_fields", None)
        if unsupported is None or not unsupported(params):
            out[name] = params
    return out


def time_steps(bb, rows: int, params: SamplingParams, steps: int, prompt_len: int, weight_kernel: str = "auto",
               dtype: torch.dtype | None = None) -> float:
    engine = NativeEngine(bb.model, bb.tokenizer, None, EngineConfig(
        max_batch_rows=rows, max_prefill_rows=rows, max_batch_tokens=rows * (prompt_len + params.max_new_tokens),
        max_step_tokens=rows * (prompt_len + 1) + 1,  # every prompt in the first step
        tuning=Tuning(weight_kernel=weight_kernel), dtype=dtype))
    prompt = [int(t) % 200 + 10 for t in range(prompt_len)]
    for _ in range(rows):
        engine.submit(GenRequest(list(prompt), params))
    engine.step()  # admission + prefill + first decode
    engine.step()  # warm
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - started) / steps
    assert engine.running == rows, "rows finished early: raise max_new_tokens"
    return elapsed


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def pair_up(kernels: list[str], dtypes: list[str | None]) -> list[tuple[str, str | None]]:
    """The turns of a repeat: the i-th kernel setting with the i-th dtype; a single value of either
    goes with every value of the other."""
    if len(kernels) != len(dtypes) and 1 not in (len(kernels), len(dtypes)):
        raise SystemExit(f"--weight-kernels ({len(kernels)}) and --dtypes ({len(dtypes)}) pair up: "
                         "give as many of each, or one of either")
    n = max(len(kernels), len(dtypes))
    return [(kernels[i if len(kernels) > 1 else 0], dtypes[i if len(dtypes) > 1 else 0]) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backbone", default="tiny")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--weight-kernels", nargs="+", choices=["auto", "on", "off"], default=["auto"],
                    help="the engine's POLYSERVE_WEIGHT_KERNEL; more than one: greedy steps only, the settings "
                         "taking turns in each repeat (e.g. off on: dense float32 weights against the GGUF blocks)")
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=None,
                    help="the engine's serving dtype per turn, paired with --weight-kernels (default: the model's, "
                         "float32)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bb = load_backbone(args.backbone)
    table = variants(args.steps + 4)
    turns = pair_up(args.weight_kernels, args.dtypes or [None])
    if len(turns) > 1:
        table = {f"greedy, {d or 'float32'} weights {w}": table["greedy"] for w, d in turns}
        configs = dict(zip(table, turns, strict=True))
    else:
        configs = {name: turns[0] for name in table}
    with torch.inference_mode():
        for rows in args.rows:
            times: dict[str, list[float]] = {name: [] for name in table}
            for _ in range(args.repeats):
                for name, params in table.items():
                    kernel, dtype = configs[name]
                    times[name].append(time_steps(bb, rows, params, args.steps, args.prompt_len, kernel,
                                                  DTYPES[dtype] if dtype else None))
            ref = statistics.median(next(iter(times.values())))
            for name, ts in times.items():
                med = statistics.median(ts)
                print(f"{args.backbone:8s} rows={rows:3d} {name:18s} {med * 1e3:9.3f} ms/step  x{med / ref:.3f}"
                      f"  ({', '.join(f'{t * 1e3:.1f}' for t in ts)})", flush=True)

if __name__ == "__main__":
    main()
